"""Regional ``torch.compile`` (``train.compile: layers``, ``csbp.training.compile_regions``).

* On 2 gloo ranks (CSBP ``cp=2, bp=2``) a compiled, checkpointed float64 step gives the eager step's
  loss and every gradient to round-off, for the decoder and for a DFlash drafter; each region
  compiles once for all layers (4 graphs for 3 layers, not 12), and a second step compiles nothing.
* Under FSDP2 with activation checkpointing (``dp=2``), a compiled layout passes ``csbp verify``'s
  check against the single-process dense reference.
* The regions leave the module as it was (names, state dict); the config key reaches the model the
  trainer builds; a machine without a compiler is refused in one line before any weight is built.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.utils import counters

from csbp.dflash.rank_plan import build_dflash_rank_plan
from csbp.dflash.step import DFlashStep
from csbp.dflash.verify import DFlashVerifyCase, anchor_generator, build_models, make_batch
from csbp.engine.block_diffusion import build_rank_plan, rank_loss
from csbp.engine.context import build_parallel_context
from csbp.engine.verify import VerifyCase, corrupted_batch, tiny_model_config, verify
from csbp.models.decoder import Decoder
from csbp.parallel.launch import run_local
from csbp.topology import Topology
from csbp.training import compile_regions, train
from csbp.training.activation_checkpointing import checkpoint_layers
from csbp.training.compile_regions import (
    check_compile_runs_on,
    compile_layers,
    compiled_layer_count,
    compiler_problem,
)
from csbp.training.model_factory import build_model
from test_training_run import make_artifact, tiny_config

ROUND_OFF = 1e-12  # float64: a fused kernel may sum in another order
FP64 = {"train.precision": "fp64", "model.dtype": "float64"}


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def _worst(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys() and a
    return max(float((a[n] - b[n]).abs().max() / b[n].abs().max().clamp_min(1e-300)) for n in a)


def _graphs() -> int:
    return int(counters["stats"]["unique_graphs"])


def _exactness_worker(rank: int, world: int) -> dict[str, object]:
    torch._dynamo.reset()
    case = VerifyCase(Topology(cp=2, bp=2))
    ctx = build_parallel_context(case.topology)
    plan = build_rank_plan(ctx, case.seq_len, case.block_size)
    corrupted = corrupted_batch(case)
    results: dict[str, object] = {}
    losses, grads = [], []
    for compiled in (False, True):
        model = Decoder(tiny_model_config(num_layers=3), dtype=torch.float64, seed=0)
        if compiled:
            assert compile_layers(model.layers, "layers") == 3
        checkpoint_layers(model.layers, "full", ctx.counter)
        graphs = _graphs()
        for _ in range(2):  # the second step must reuse every graph
            model.zero_grad(set_to_none=True)
            loss, _ = rank_loss(model, corrupted, plan, global_denominator=corrupted.denominator(),
                                world_size=ctx.world_size)
            loss.backward()
            if compiled and "first_step_graphs" not in results:
                results["first_step_graphs"] = _graphs() - graphs
        losses.append(float(loss))
        grads.append(_grads(model))
    results["second_step_graphs"] = _graphs() - graphs - int(results["first_step_graphs"])  # type: ignore[arg-type]
    results["decoder_loss_err"] = abs(losses[1] - losses[0]) / abs(losses[0])
    results["decoder_grad_err"] = _worst(grads[1], grads[0])

    dcase = DFlashVerifyCase(Topology(cp=2, bp=2))
    batch = make_batch(dcase.samples, dcase.seq_len, seed=dcase.seed)
    dlosses, dgrads = [], []
    for compiled in (False, True):
        _, drafter = build_models(dcase)
        compile_layers(drafter.layers, "layers" if compiled else "none")
        compile_layers(drafter.target.layers, "layers" if compiled else "none")  # its online feature pass
        step = DFlashStep(drafter, dcase.objective, build_dflash_rank_plan(ctx, dcase.objective))
        out = step(batch, anchor_generator(dcase, 0), selector_scale=0.0)
        out.loss.backward()
        dlosses.append(float(out.loss))
        dgrads.append(_grads(drafter))
    results["drafter_compiled"] = compiled_layer_count(drafter.layers)
    results["drafter_loss_err"] = abs(dlosses[1] - dlosses[0]) / abs(dlosses[0])
    results["drafter_grad_err"] = _worst(dgrads[1], dgrads[0])
    return results


@pytest.mark.multiprocess
@pytest.mark.slow
def test_compiled_steps_match_eager_and_compile_each_region_once() -> None:
    for rank, result in enumerate(run_local(_exactness_worker, 2, timeout_s=400)):
        assert result["decoder_loss_err"] <= ROUND_OFF and result["decoder_grad_err"] <= ROUND_OFF, (rank, result)
        assert result["drafter_loss_err"] <= ROUND_OFF and result["drafter_grad_err"] <= ROUND_OFF, (rank, result)
        # two norms, the MLP, the query and the key/value projections: once for all three layers
        # (backward graphs are not counted by dynamo; its forward graphs are)
        assert result["first_step_graphs"] == 4, (rank, result)
        assert result["second_step_graphs"] == 0, (rank, result)
        assert result["drafter_compiled"] == 2, (rank, result)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_compiled_fsdp_layout_passes_verification_against_the_dense_reference() -> None:
    result = verify(VerifyCase(Topology(dp=2), fsdp=True, activation_checkpointing="full", compile=True),
                    timeout_s=400)
    assert result.ok, result


def test_compiled_regions_leave_the_module_as_it_was() -> None:
    plain = Decoder(tiny_model_config(num_layers=2), dtype=torch.float64, seed=0)
    compiled = Decoder(tiny_model_config(num_layers=2), dtype=torch.float64, seed=0)
    assert compiled_layer_count(compiled.layers) == 0
    assert compile_layers(compiled.layers, "layers") == 2 and compiled_layer_count(compiled.layers) == 2
    assert compile_layers(plain.layers, "none") == 0 and compiled_layer_count(plain.layers) == 0
    assert list(compiled.state_dict()) == list(plain.state_dict())
    assert [n for n, _ in compiled.named_modules()] == [n for n, _ in plain.named_modules()]
    attention = compiled.layers[1].self_attn
    assert isinstance(attention.project_query, functools.partial) and attention.project_query.args == (attention,)


def test_unknown_mode_and_layers_without_attention_are_refused() -> None:
    with pytest.raises(ValueError, match=r"^train.compile: 'all' is not one of \('none', 'layers'\)$"):
        compile_layers([], "all")
    with pytest.raises(TypeError, match="Linear has no self_attn"):
        compile_layers([nn.Linear(2, 2)], "layers")


def test_the_config_key_reaches_the_trainers_model(tmp_path) -> None:
    cfg = tiny_config(tmp_path / "data", **{"train.compile": "layers"})
    model = build_model(cfg, tiny_model_config(), device=torch.device("cpu"))
    assert compiled_layer_count(model.layers) == len(model.layers) > 0
    assert tiny_config(tmp_path / "data").train.compile == "none"
    with pytest.raises(ValueError, match="compile"):
        tiny_config(tmp_path / "data", **{"train.compile": "yes"})


@pytest.mark.slow
def test_a_compiled_run_logs_the_eager_runs_losses(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Through ``train``: steps, validation passes (no-grad graphs) and checkpoints of a compiled model."""
    artifact = make_artifact(tmp_path / "art")
    eager = train(tiny_config(artifact, **FP64), run_dir=tmp_path / "eager")
    assert "compiles the layers" not in capsys.readouterr().out
    compiled = train(tiny_config(artifact, **{**FP64, "train.compile": "layers"}),
                     run_dir=tmp_path / "compiled")
    # the slow first step is announced, not a silent stall
    assert "note: train.compile=layers compiles the layers during the first step" in capsys.readouterr().out
    assert len(eager.losses) == 4 and len(eager.val_losses) > 0
    assert compiled.losses == pytest.approx(eager.losses, rel=ROUND_OFF)
    assert [step for step, _ in compiled.val_losses] == [step for step, _ in eager.val_losses]
    assert [v for _, v in compiled.val_losses] == pytest.approx([v for _, v in eager.val_losses], rel=ROUND_OFF)
    assert compiled.checkpoint is not None


def test_the_trainer_refuses_compile_without_a_compiler_before_building_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import csbp.training.trainer as trainer_module

    artifact = make_artifact(tmp_path / "art")
    monkeypatch.setattr(compile_regions, "compiler_problem", lambda device: "no compiler here")
    monkeypatch.setattr(trainer_module, "build_model", lambda *a, **k: pytest.fail("weights were built"))
    with pytest.raises(ValueError, match=r"^train.compile=layers cannot compile on cpu: no compiler here"):
        train(tiny_config(artifact, **{"train.compile": "layers"}), run_dir=tmp_path / "run")


def test_a_machine_without_a_compiler_is_refused_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch._inductor.cpp_builder as cpp_builder
    import torch.utils._triton as triton_utils

    assert compiler_problem("cpu") is None  # this machine compiles (the tests above need it)
    check_compile_runs_on("none", "meta")  # nothing to compile: nothing to check

    def no_compiler() -> str:
        raise RuntimeError("No working C++ compiler found in cpp_builder.py\nmore detail")

    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", no_compiler)
    with pytest.raises(ValueError) as refused:
        check_compile_runs_on("layers", "cpu")
    assert str(refused.value) == (
        "train.compile=layers cannot compile on cpu: inductor finds no C++ compiler (No working C++ compiler "
        "found in cpp_builder.py) (fix: install one, or set train.compile to none)"
    )
    monkeypatch.setattr(triton_utils, "has_triton", lambda: False)
    assert compiler_problem("cuda") == "Triton is not installed (it comes with torch's CUDA wheels)"
    monkeypatch.setattr(triton_utils, "has_triton", lambda: True)
    monkeypatch.setattr(compile_regions.shutil, "which", lambda name: None)
    assert "no C compiler (cc, gcc or clang)" in str(compiler_problem("cuda"))
    monkeypatch.setattr(compile_regions.shutil, "which", lambda name: "/usr/bin/gcc" if name == "gcc" else None)
    assert compiler_problem("cuda") is None
    assert compiler_problem("meta") == "csbp compiles layers on cuda and cpu only, not meta"


def test_the_first_step_note_names_every_compilation() -> None:
    """On CUDA the default backend (flex) compiles its kernels in the first step too: tens of seconds with
    nothing said looked like a hang, and that step's tokens/s like the run's."""
    from csbp.training.trainer import first_step_note

    assert first_step_note("none", "tiles") is None
    flex = first_step_note("none", "flex")
    assert flex is not None and flex.startswith("note: attention.backend flex compiles its FlexAttention kernels during")
    both = first_step_note("layers", "flex")
    assert both is not None and both.startswith(
        "note: train.compile=layers compiles the layers and attention.backend flex compiles its FlexAttention "
        "kernels during the first step and the first validation pass (slower: that step's tokens_per_s and mfu "
        "include it)"
    )
