"""A step that runs out of memory ends the run with one line naming the fixes that apply
(``csbp.training.out_of_memory``), on the GPU (``torch.OutOfMemoryError``) and on the CPU (the
allocator's ``RuntimeError``), in one process and as a launched rank's reported error."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from csbp.cli.main import main
from csbp.training import train
from csbp.training.launch_failures import failure_from_elastic
from csbp.training.out_of_memory import (
    OutOfDeviceMemory,
    is_out_of_memory,
    memory_fixes,
    out_of_memory_message,
)
from csbp.training.step import StepRunner
from test_training_run import config_dict, make_artifact, tiny_config

CPU_FAILURE = (
    "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to "
    "allocate 1125899906842624 bytes. Error code 12 (Cannot allocate memory)"
)


def test_allocation_failures_are_told_from_other_errors() -> None:
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    with pytest.raises(RuntimeError) as real:
        torch.empty(2**50, dtype=torch.uint8)  # the CPU allocator's own failure
    assert is_out_of_memory(real.value)
    assert not is_out_of_memory(RuntimeError("shape mismatch")) and not is_out_of_memory(ValueError(CPU_FAILURE))


def test_only_the_fixes_a_config_has_not_made_are_named(tmp_path: Path) -> None:
    plain = tiny_config(tmp_path, **{"train.micro_batch_size": 4, "train.grad_accum": 2, "topology.dp": 2})
    assert memory_fixes(plain) == [
        "train.activation_checkpointing: full (keeps one layer's activations, not all)",
        "train.micro_batch_size: 2 with train.grad_accum: 4 (the same tokens per step)",
        "train.fsdp: true (shards weights, gradients and AdamW state over the dp ranks)",
        "more ranks per sample (topology.cp / topology.bp) to split each sequence",
        "objective.ce_chunk_rows: 256 (a smaller logits chunk)",
    ]
    done = tiny_config(tmp_path, **{
        "train.micro_batch_size": 1, "train.activation_checkpointing": "full", "topology.dp": 2,
        "train.fsdp": True, "objective.ce_chunk_rows": 256,
    })
    assert memory_fixes(done) == ["more ranks per sample (topology.cp / topology.bp) to split each sequence"]
    selective = tiny_config(tmp_path, **{
        "train.micro_batch_size": 1, "train.activation_checkpointing": "selective", "topology.dp": 2,
        "train.fsdp": True, "objective.ce_chunk_rows": 256,
    })
    assert memory_fixes(selective)[0].startswith("train.activation_checkpointing: full (recomputes the attention")
    one_replica = tiny_config(tmp_path, **{"train.micro_batch_size": 1, "train.activation_checkpointing": "full"})
    assert not any("fsdp" in fix for fix in memory_fixes(one_replica))  # nothing to shard over
    assert not any("ema_decay" in fix for fix in memory_fixes(one_replica))
    averaged = tiny_config(tmp_path, **{"train.micro_batch_size": 1, "train.activation_checkpointing": "full",
                                        "optim.ema_decay": 0.999})  # the launch check names it; so must this
    assert memory_fixes(averaged)[-1] == "optim.ema_decay: null (drops the weight average's copy of the weights)"


def test_no_fix_is_named_that_the_config_rules_refuse_or_that_changes_the_tokens_per_step(tmp_path: Path) -> None:
    from csbp.config.loading import config_from_dict
    from test_training_dflash import dflash_dict

    dflash = dflash_dict(tmp_path, Path("/models/t"), **{"topology.dp": 2, "train.micro_batch_size": 3,
                                                            "train.grad_accum": 1})
    fixes = memory_fixes(config_from_dict(dflash))
    assert not any("fsdp" in fix for fix in fixes)  # refused for dflash: every rank holds the drafter
    assert "train.micro_batch_size: 1 with train.grad_accum: 3 (the same tokens per step)" in fixes  # not 1 x 2
    lam = dflash_dict(tmp_path, Path("/models/t"), **{"objective.dflash.lk_loss_type": "lambda", "train.grad_accum": 1})
    assert not any("grad_accum" in fix for fix in memory_fixes(config_from_dict(lam)))  # refused with lambda
    for name in ("mdlm", "ar"):  # single streams: the rules refuse cp and bp
        single = config_dict(tmp_path, **{"objective.name": name, "objective.block_size": None,
                                           "train.micro_batch_size": 1, "train.activation_checkpointing": "full",
                                           "objective.ce_chunk_rows": 256})
        assert memory_fixes(config_from_dict(single)) == [
            "a shorter data.seq_len, a smaller model or a device with more memory"
        ]


def test_the_message_names_rank_step_and_torchs_first_line(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path, **{"train.micro_batch_size": 1, "train.activation_checkpointing": "full"})
    error = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.\nGPU 0 has a total capacity ...")
    message = out_of_memory_message(cfg, error, rank=3, step=7, device=torch.device("cpu"))
    assert message == (
        "rank 3 ran out of memory on cpu after step 7: activations, gathered K/V and the logits chunk come on top "
        "of the weights (fix: more ranks per sample (topology.cp / topology.bp) to split each sequence; or "
        "objective.ce_chunk_rows: 256 (a smaller logits chunk); `csbp plan --model <this config> --gpus N` "
        "predicts which layouts fit) [CUDA out of memory. Tried to allocate 2.00 GiB.]"
    )


@pytest.mark.parametrize(
    "failure", [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB"), RuntimeError(CPU_FAILURE)]
)
def test_a_step_out_of_memory_ends_train_with_the_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failure: Exception
) -> None:
    artifact = make_artifact(tmp_path / "art")
    real_step = StepRunner.train_step

    def failing_step(self: StepRunner, batches, step: int):  # type: ignore[no-untyped-def]
        if step == 3:
            raise failure
        return real_step(self, batches, step)

    monkeypatch.setattr(StepRunner, "train_step", failing_step)
    with pytest.raises(OutOfDeviceMemory, match=r"^rank 0 ran out of memory on cpu after step 2: .*train\."
                       r"activation_checkpointing: full .*\[(CUDA out of memory|\[enforce fail)") as info:
        train(tiny_config(artifact), run_dir=tmp_path / "run")
    assert info.value.__cause__ is failure
    other = RuntimeError("not memory")
    monkeypatch.setattr(StepRunner, "train_step", lambda self, batches, step: (_ for _ in ()).throw(other))
    with pytest.raises(RuntimeError, match="^not memory$"):  # any other error passes unchanged
        train(tiny_config(artifact), run_dir=tmp_path / "run2")


def test_csbp_train_prints_one_line_without_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    artifact = make_artifact(tmp_path / "art")
    config = tmp_path / "run.yaml"
    config.write_text(json.dumps(config_dict(artifact)), encoding="utf-8")
    monkeypatch.setattr(StepRunner, "train_step", lambda self, batches, step: (_ for _ in ()).throw(
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")))
    assert main(["train", str(config), "--run-dir", str(tmp_path / "run")]) != 0
    err = capsys.readouterr().err
    assert err.startswith("csbp: error: rank 0 ran out of memory on cpu after step 0: ") and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_a_launched_ranks_out_of_memory_is_reported_as_expected_without_a_traceback() -> None:
    def failure(text: str, timestamp: int) -> SimpleNamespace:
        return SimpleNamespace(message={"message": text, "extraInfo": {"py_callstack": "Traceback ..."}},
                               timestamp=timestamp, exitcode=1)

    failures = {
        0: failure("TrainingFailed: rank 0: a collective failed or timed out; another rank probably died", 2),
        1: failure("OutOfDeviceMemory: rank 1 ran out of memory on cuda:1 after step 5: ...", 1),
    }
    reported = failure_from_elastic(SimpleNamespace(failures=failures, get_first_failure=lambda: (0, failures[0])))
    assert str(reported) == "training failed on rank 1: OutOfDeviceMemory: rank 1 ran out of memory on cuda:1 after step 5: ..."
    assert reported.expected  # csbp train shows the line, not the traceback (unless --debug)


def test_on_cuda_the_line_says_how_much_the_gpu_held(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tiny_config(tmp_path, **{"train.micro_batch_size": 1, "train.activation_checkpointing": "full"})
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=140 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: int(131.25 * 2**30))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H200")
    message = out_of_memory_message(cfg, torch.OutOfMemoryError("CUDA out of memory"), rank=1, step=2,
                                    device=torch.device("cuda", 1))
    assert message.startswith("rank 1 ran out of memory on cuda:1 after step 2 (NVIDIA H200: 131.2 of 140.0 GiB "
                              "allocated): activations")

    def no_answer(device: object) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(torch.cuda, "memory_allocated", no_answer)  # the report must not fail on the way
    message = out_of_memory_message(cfg, torch.OutOfMemoryError("CUDA out of memory"), rank=1, step=2,
                                    device=torch.device("cuda", 1))
    assert message.startswith("rank 1 ran out of memory on cuda:1 after step 2: activations")


def test_an_out_of_memory_met_while_compiling_or_chained_is_recognised() -> None:
    """torch.compile wraps an allocation failure met while compiling in BackendCompilerFailed (its
    inner_exception), which is no OutOfMemoryError: it passed as a traceback."""
    from torch._dynamo.exc import BackendCompilerFailed

    def compile_failure(inner: Exception) -> BackendCompilerFailed:
        try:  # torch 2.13 takes the first useful frame too; older versions do not
            return BackendCompilerFailed(lambda gm, inputs: gm, inner, None)
        except TypeError:
            return BackendCompilerFailed(lambda gm, inputs: gm, inner)  # type: ignore[call-arg]

    assert is_out_of_memory(compile_failure(torch.OutOfMemoryError("CUDA out of memory")))
    try:
        try:
            raise RuntimeError(CPU_FAILURE)
        except RuntimeError as cause:
            raise ValueError("while building the plan") from cause
    except ValueError as chained:
        assert is_out_of_memory(chained)
    assert not is_out_of_memory(compile_failure(RuntimeError("unsupported op")))
