"""A model too large for the memory of a rank is refused in one line naming the field, before any
rank starts (``--set model.hidden_size=10**12`` used to crash every rank in the allocator, and
``model.num_layers=10**12`` hung building layers); ``train.grad_accum`` past the training split is
refused too."""

from __future__ import annotations

import math
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from csbp.data.artifact import open_artifact
from csbp.training import launch_training
from csbp.training.memory_fit import SMALLEST_SHAPE, check_state_fits, rank_memory_bytes, state_bytes
from csbp.training.preflight import check_run
from test_training_dflash import dflash_config, export_target
from test_training_run import make_artifact, tiny_config

HUGE = 10**12


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_artifact(tmp_path_factory.mktemp("data") / "art")


@pytest.mark.parametrize(
    "field", ["hidden_size", "intermediate_size", "num_layers", "num_heads", "head_dim", "vocab_size"]
)
def test_an_absurd_shape_is_refused_before_any_rank_starts(field: str, artifact: Path, tmp_path: Path) -> None:
    value = HUGE + HUGE % 2 if field != "num_heads" else 2 * HUGE  # head_dim even; heads a multiple of kv heads
    cfg = tiny_config(artifact, **{f"model.{field}": value})
    with pytest.raises(ValueError) as refused:
        launch_training(cfg, run_dir=tmp_path / "run", max_steps=1)
    line = str(refused.value)
    assert "\n" not in line
    assert re.match(rf"model\.{field}: training holds at least [0-9.e+,]+ GiB per rank", line), line
    assert f"(fix: a smaller model.{field} (now {value})" in line
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())  # nothing written


def test_the_bound_is_four_master_copies_of_every_parameter_sharded_by_fsdp(artifact: Path) -> None:
    inputs = check_run(tiny_config(artifact), check_device=False)
    n = inputs.decoder_config.num_parameters()
    assert state_bytes(inputs, fp64=False, shards=1) == 16 * n
    assert state_bytes(inputs, fp64=True, shards=1) == 32 * n
    assert state_bytes(inputs, fp64=False, shards=4) == 16 * n // 4


def test_a_model_that_fits_passes_and_one_byte_less_is_refused(artifact: Path) -> None:
    cfg = tiny_config(artifact)
    inputs = check_run(cfg, check_device=False)
    need = state_bytes(inputs, fp64=False, shards=1)
    check_state_fits(cfg, inputs, local_ranks=1, memory=need)
    with pytest.raises(ValueError, match=r"more than the .* of this machine's RAM and swap shared by 1 rank"):
        check_state_fits(cfg, inputs, local_ranks=1, memory=need - 1)


def test_fsdp_is_offered_only_where_sharding_would_fit(artifact: Path) -> None:
    cfg = tiny_config(artifact, **{"topology.dp": 4, "train.eval_batches": 1})
    inputs = check_run(cfg, check_device=False)
    need = state_bytes(inputs, fp64=False, shards=1)
    with pytest.raises(ValueError, match=r"or train\.fsdp: true \(shards it over the dp=4 ranks\)"):
        check_state_fits(cfg, inputs, local_ranks=4, memory=need // 2)
    with pytest.raises(ValueError) as refused:
        check_state_fits(cfg, inputs, local_ranks=4, memory=need // 8)
    assert "fsdp" not in str(refused.value)


@pytest.mark.parametrize("field", sorted(SMALLEST_SHAPE))
def test_the_field_named_is_the_one_that_is_out_of_scale(field: str, artifact: Path) -> None:
    changes: dict[str, Any] = {f"model.{field}": 2 * HUGE}
    if field == "num_kv_heads":
        changes["model.num_heads"] = 2 * HUGE
    cfg = tiny_config(artifact, **changes)
    inputs = check_run(cfg, check_device=False)
    with pytest.raises(ValueError, match=rf"^model\.{field}: "):
        check_state_fits(cfg, inputs, local_ranks=1, memory=2**40)


def test_this_machine_s_memory_is_read_per_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the CPU's memory, on any machine
    one, two = rank_memory_bytes(1), rank_memory_bytes(2)
    if one is None:
        pytest.skip("/proc/meminfo is not readable here")
    assert one > 2**28 and two == one // 2


def test_on_the_cpu_a_rank_has_its_share_of_ram_and_swap(monkeypatch: pytest.MonkeyPatch) -> None:
    """The module's rule: the machine's RAM and swap shared by the node's processes (without swap the
    bound refused CPU runs that fit); an unreadable /proc/meminfo refuses nothing."""
    import csbp.training.memory_fit as memory_fit

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(memory_fit, "meminfo_kib", lambda: {"MemTotal": 3000, "SwapTotal": 1000})
    assert rank_memory_bytes(2) == 4000 * 1024 // 2
    monkeypatch.setattr(memory_fit, "meminfo_kib", lambda: {})
    assert rank_memory_bytes(2) is None


def test_more_micro_steps_than_the_split_has_rows_is_noted_not_refused(artifact: Path) -> None:
    """A step may read the split more than once (few long rows on many ranks), so it trains, with a note."""
    notes: list[str] = []
    check_run(tiny_config(artifact, **{"train.grad_accum": HUGE}), check_device=False, warn=notes.append)
    assert any(
        re.match(rf"note: train\.grad_accum {HUGE} x 2 sequences = .*\(train\.grad_accum <= \d+ reads each row", n)
        for n in notes
    ), notes
    notes.clear()
    check_run(tiny_config(artifact), check_device=False, warn=notes.append)
    assert not any("grad_accum" in n for n in notes)


@pytest.fixture(scope="module")
def dflash_inputs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("dflash")
    artifact = make_artifact(root / "art")
    return artifact, export_target(root / "target", open_artifact(artifact).vocab_size, tokenizer_dir=artifact)


def test_a_drafter_counts_its_trained_layers_and_its_whole_frozen_target(dflash_inputs: tuple[Path, Path]) -> None:
    small = {"objective.dflash.num_draft_layers": 1, "objective.dflash.intermediate_size": 2, "objective.dflash.target_layer_ids": [1]}
    cfg = dflash_config(*dflash_inputs, **small)  # a drafter much smaller than its target
    inputs = check_run(cfg, check_device=False)
    assert inputs.dflash is not None
    drafter = inputs.dflash.drafter_config
    trained = drafter.decoder_config().num_parameters(include_embeddings=False) + drafter.feature_width * 32
    assert sum(math.prod(s) for s in inputs.param_shapes().values()) >= trained  # a lower bound of the drafter
    frozen = inputs.decoder_config.num_parameters()
    assert state_bytes(inputs, fp64=False, shards=1) == 16 * trained + 4 * frozen
    with pytest.raises(ValueError, match=r"^objective\.dflash\.target: .*a smaller target \(every rank loads it whole\)"):
        check_state_fits(cfg, inputs, local_ranks=1, memory=4 * frozen)
    wide = dflash_config(*dflash_inputs, **{"objective.dflash.intermediate_size": HUGE})
    with pytest.raises(ValueError, match=r"^objective\.dflash: .* intermediate_size \(now 1000000000000\)"):
        check_state_fits(wide, check_run(wide, check_device=False), local_ranks=1, memory=2**40)


def test_on_cuda_a_rank_has_the_smallest_memory_of_the_gpus_the_node_uses(monkeypatch: pytest.MonkeyPatch) -> None:
    sizes = [80 * 2**30, 40 * 2**30, 10 * 2**30]  # the third GPU is not used by a 2-process node
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(sizes))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=sizes[i]))
    assert rank_memory_bytes(2) == 40 * 2**30
    assert rank_memory_bytes(1) == 80 * 2**30
    assert rank_memory_bytes(3) == 10 * 2**30


def test_a_drafter_deeper_than_its_target_is_refused_before_its_layers_are_listed(
    dflash_inputs: tuple[Path, Path],
) -> None:
    """``num_draft_layers=10**12`` was a bare MemoryError: the layer-type list is built before any memory check."""
    cfg = dflash_config(*dflash_inputs, **{"objective.dflash.num_draft_layers": HUGE})
    with pytest.raises(ValueError, match=r"^objective\.dflash\.num_draft_layers: 1000000000000 draft layers, more than the 4 "):
        check_run(cfg, check_device=False)


def test_fsdp_is_never_offered_to_a_drafter(dflash_inputs: tuple[Path, Path]) -> None:
    """dflash refuses train.fsdp (every rank holds the small drafter whole)."""
    cfg = dflash_config(*dflash_inputs, **{"topology.dp": 2, "train.eval_batches": 1})
    inputs = check_run(cfg, check_device=False)
    with pytest.raises(ValueError) as refused:
        check_state_fits(cfg, inputs, local_ranks=2, memory=state_bytes(inputs, fp64=False, shards=1) - 1)
    assert "fsdp" not in str(refused.value)


def test_fp64_doubles_the_bound_the_check_compares(artifact: Path) -> None:
    """Mutation audit: ``check_state_fits`` reading fp32's 4 bytes a value under ``train.precision: fp64``
    survived (the tests priced fp64 through ``state_bytes`` only)."""
    cfg = tiny_config(artifact, **{"train.precision": "fp64", "model.dtype": "float64"})
    inputs = check_run(cfg, check_device=False)
    need = state_bytes(inputs, fp64=True, shards=1)
    check_state_fits(cfg, inputs, local_ranks=1, memory=need)
    with pytest.raises(ValueError, match=r"^model\.\w+: training holds at least "):
        check_state_fits(cfg, inputs, local_ranks=1, memory=need // 2)


def test_fsdp_is_offered_when_the_shards_fit_exactly(artifact: Path) -> None:
    """The fsdp offer's bound is the check's own (``<=``): a shard that fits to the byte is offered."""
    cfg = tiny_config(artifact, **{"topology.dp": 4, "train.eval_batches": 1})
    inputs = check_run(cfg, check_device=False)
    sharded = state_bytes(inputs, fp64=False, shards=4)
    with pytest.raises(ValueError, match=r"or train\.fsdp: true \(shards it over the dp=4 ranks\)"):
        check_state_fits(cfg, inputs, local_ranks=4, memory=sharded)
    with pytest.raises(ValueError) as refused:
        check_state_fits(cfg, inputs, local_ranks=4, memory=sharded - 1)
    assert "fsdp" not in str(refused.value)


def test_unknown_memory_refuses_nothing(artifact: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where ``/proc/meminfo`` cannot be read nothing is refused on a guess, however large the model."""
    import csbp.training.memory_fit as memory_fit

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(memory_fit, "meminfo_kib", lambda: {})
    cfg = tiny_config(artifact, **{"model.hidden_size": HUGE})
    check_state_fits(cfg, check_run(cfg, check_device=False), local_ranks=1)


def test_a_model_loaded_from_init_from_names_init_from(artifact: Path) -> None:
    """Its shape comes from the checkpoint, so no ``model.*`` field is the one to change."""
    cfg = tiny_config(artifact)
    inputs = check_run(cfg, check_device=False)
    loaded = cfg.model_copy(update={"model": cfg.model.model_copy(update={"init_from": "/models/big"})})
    with pytest.raises(ValueError, match=r"^model\.init_from: .*\(fix: a smaller checkpoint, or more memory per rank;"):
        check_state_fits(loaded, inputs, local_ranks=1, memory=1)


def test_a_target_under_four_drafters_names_the_drafter(dflash_inputs: tuple[Path, Path]) -> None:
    """The target is named only when it outweighs the drafter's 4 trained copies (here the target has
    about 3 drafters' parameters, so shrinking the drafter is the fix)."""
    cfg = dflash_config(*dflash_inputs)
    inputs = check_run(cfg, check_device=False)
    assert inputs.dflash is not None
    trained = inputs.dflash.drafter_config.decoder_config().num_parameters(include_embeddings=False)
    assert trained <= inputs.decoder_config.num_parameters() < 4 * trained
    with pytest.raises(ValueError, match=r"^objective\.dflash: .*num_draft_layers \(now 2\), intermediate_size \(now 64\)"):
        check_state_fits(cfg, inputs, local_ranks=1, memory=state_bytes(inputs, fp64=False, shards=1) - 1)
