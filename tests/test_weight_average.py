"""The weight average of ``optim.ema_decay`` (csbp.training.weight_average).

* The update is MDLM's ``ExponentialMovingAverage`` with ``use_num_updates``, written out here from
  the trained weights recorded after every step: the final export equals it (float32, 1e-6).
* It never reaches training: the losses of a run with it are bit-identical to the run without it,
  while its validation differs; a resumed run repeats the uninterrupted one bit for bit, export too.
* Switched on at a resume it starts from the resumed weights; switched off, it is dropped; both say so.
* ``csbp export``: the average by default, ``--weights raw`` the trained weights (a tied LM head
  follows its embedding), ``--weights ema`` refused on a checkpoint without one.
* Under FSDP (2 gloo ranks): the same losses as without it (FSDP's root keeps its gathered weights after
  a validation forward; the swap makes it gather afresh) and the same export as plain data parallelism,
  also when a resume switches FSDP on or off (DCP reshards the average as it does the weights).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import load_file

from csbp.cli.main import main as csbp_main
from csbp.config import ConfigError
from csbp.parallel.launch import run_local
from csbp.training import train, weight_average
from csbp.training.weight_average import WeightAverage, warmed_decay
from test_config import dflash_changes, with_changes
from test_training_run import make_artifact, metric_rows, tiny_config, trajectory

DECAY = 0.9
AVERAGED = {"optim.ema_decay": DECAY}


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_artifact(tmp_path_factory.mktemp("data") / "art")


class _Recorder:
    """A StepHook keeping every trained parameter after each step (the loop has updated by then)."""

    def __init__(self) -> None:
        self.steps: list[dict[str, torch.Tensor]] = []

    def on_start(self, loop: Any, start_step: int) -> None:
        self.steps.append({n: p.detach().clone() for n, p in loop.model.named_parameters()})

    def after_step(self, loop: Any, step: int, step_seconds: float) -> bool:
        self.steps.append({n: p.detach().clone() for n, p in loop.model.named_parameters()})
        return False


def _exported(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "final" / "model.safetensors"))


def test_the_warm_up_is_mdlms() -> None:
    assert [warmed_decay(0.9999, n) for n in (1, 2, 10)] == [2 / 11, 3 / 12, 11 / 20]
    assert warmed_decay(0.5, 100) == 0.5


def test_the_swap_puts_the_average_in_and_the_weights_back_bit_for_bit() -> None:
    model = torch.nn.Linear(3, 2)
    average = WeightAverage(model, 0.5)
    trained = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        model.weight.add_(1.0)
    average.update()
    moved = {n: p.detach().clone() for n, p in model.named_parameters()}
    with average.swapped_in():  # n = 1: the average moved 1 - 2/11 of the way
        torch.testing.assert_close(model.weight, trained["weight"] + 9 / 11)
        assert torch.equal(model.bias, trained["bias"])
    assert all(torch.equal(p, moved[n]) for n, p in model.named_parameters())


class _Shapes(torch.nn.Module):
    """Parameters of every awkward kind: several chunks, non-contiguous, a scalar, empty, two dtypes."""

    def __init__(self) -> None:
        super().__init__()
        self.matrix = torch.nn.Parameter(torch.randn(7, 5))
        self.transposed = torch.nn.Parameter(torch.randn(5, 6).t())
        self.scalar = torch.nn.Parameter(torch.tensor(2.5))
        self.empty = torch.nn.Parameter(torch.empty(0, 3))
        self.vector64 = torch.nn.Parameter(torch.randn(9, dtype=torch.float64))


def test_the_exchange_moves_every_chunk_through_a_bounded_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(weight_average, "EXCHANGE_CHUNK", 8)  # 2 rows of `matrix` per copy
    model = _Shapes()
    assert not model.transposed.is_contiguous()
    average = WeightAverage(model, 0.5)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)
    trained = {n: p.detach().clone() for n, p in model.named_parameters()}
    shadow = {n: t.clone() for n, t in average.shadow.items()}
    allocated: list[int] = []
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda n, **kw: allocated.append(n) or real_empty(n, **kw))
    with average.swapped_in():
        assert all(torch.equal(p, shadow[n]) for n, p in model.named_parameters())
        assert all(torch.equal(average.shadow[n], trained[n]) for n in trained)
    assert all(torch.equal(p, trained[n]) for n, p in model.named_parameters())
    assert all(torch.equal(average.shadow[n], shadow[n]) for n in shadow)
    assert sorted(allocated) == [5, 5, 8, 8]  # per swap, one buffer per dtype: float32 a row of 5, float64 8 of 9


def test_running_out_of_memory_for_the_exchange_leaves_the_model_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _Shapes()
    average = WeightAverage(model, 0.5)
    with torch.no_grad():
        model.matrix.add_(1.0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}

    calls: list[int] = []
    real_empty = torch.empty

    def out_of_memory_at_the_second_buffer(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(1)
        if len(calls) == 2:  # the float64 one: a lazily allocating exchange has moved float32 tensors by then
            raise torch.OutOfMemoryError("CUDA out of memory")
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", out_of_memory_at_the_second_buffer)
    with pytest.raises(torch.OutOfMemoryError), average.swapped_in():
        pass
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_the_export_is_the_average_of_the_trained_weights_and_training_never_sees_it(
    artifact: Path, tmp_path: Path
) -> None:
    recorder = _Recorder()
    summary = train(tiny_config(artifact, **AVERAGED), run_dir=tmp_path / "averaged", hook=recorder).format()
    assert "(step 4)  (weight average, optim.ema_decay 0.9)" in summary
    assert f"export      {tmp_path / 'averaged' / 'final'}  (weight average, optim.ema_decay 0.9)" in summary
    assert "weight average" not in train(tiny_config(artifact), run_dir=tmp_path / "plain").format()
    averaged, plain = metric_rows(tmp_path / "averaged"), metric_rows(tmp_path / "plain")
    assert [r.get("loss") for r in averaged] == [r.get("loss") for r in plain]
    assert [r.get("grad_norm") for r in averaged] == [r.get("grad_norm") for r in plain]
    assert averaged[0]["val_loss"] == plain[0]["val_loss"]  # step 0: the average is the initial weights
    assert averaged[-1]["val_loss"] != plain[-1]["val_loss"]  # validation runs on the average
    reference = dict(recorder.steps[0])
    for n, weights in enumerate(recorder.steps[1:], start=1):  # MDLM's update, one per applied step
        decay = min(DECAY, (1 + n) / (10 + n))
        reference = {name: reference[name] - (1 - decay) * (reference[name] - weights[name]) for name in reference}
    exported = _exported(tmp_path / "averaged")
    for name, value in reference.items():  # Hugging Face names: the decoder's under "model.", the head's not
        torch.testing.assert_close(exported.get(f"model.{name}", exported.get(name)), value, rtol=1e-6, atol=1e-7)
    assert not torch.equal(exported["model.norm.weight"], _exported(tmp_path / "plain")["model.norm.weight"])


def test_a_resumed_run_repeats_the_uninterrupted_one_average_included(artifact: Path, tmp_path: Path) -> None:
    train(tiny_config(artifact, **AVERAGED), run_dir=tmp_path / "full")
    train(tiny_config(artifact, **AVERAGED), run_dir=tmp_path / "half", max_steps=2)
    train(tiny_config(artifact, **AVERAGED), run_dir=tmp_path / "half", resume=True)
    assert trajectory(tmp_path / "half") == trajectory(tmp_path / "full")
    full, half = _exported(tmp_path / "full"), _exported(tmp_path / "half")
    assert full.keys() == half.keys() and all(torch.equal(full[k], half[k]) for k in full)


def test_switching_the_average_on_or_off_at_a_resume_says_what_happens(
    artifact: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    train(tiny_config(artifact), run_dir=tmp_path / "on", max_steps=2)
    train(tiny_config(artifact, **AVERAGED), run_dir=tmp_path / "on", resume=True)
    assert "note: optim.ema_decay: the checkpoint of step 2 has no weight average; it starts from the resumed " \
           "weights" in capsys.readouterr().out
    state = (tmp_path / "on" / "checkpoints" / "step_0000004" / "trainer_state.json").read_text()
    assert '"ema_updates": 2' in state
    train(tiny_config(artifact, **AVERAGED), run_dir=tmp_path / "off", max_steps=2)
    train(tiny_config(artifact), run_dir=tmp_path / "off", resume=True)
    assert "weight average of step 2's checkpoint is dropped" in capsys.readouterr().out
    state = (tmp_path / "off" / "checkpoints" / "step_0000004" / "trainer_state.json").read_text()
    assert '"ema_updates": null' in state


def test_csbp_export_writes_the_average_unless_asked_for_the_trained_weights(
    artifact: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tied = {"model.tie_embeddings": True}
    train(tiny_config(artifact, **AVERAGED, **tied), run_dir=tmp_path / "run")
    train(tiny_config(artifact, **tied), run_dir=tmp_path / "plain")
    checkpoint = tmp_path / "run" / "checkpoints" / "step_0000004"
    assert csbp_main(["export", str(checkpoint), "--out", str(tmp_path / "ema")]) == 0
    assert csbp_main(["export", str(checkpoint), "--out", str(tmp_path / "raw"), "--weights", "raw"]) == 0
    final, ema = _exported(tmp_path / "run"), load_file(str(tmp_path / "ema" / "model.safetensors"))
    raw, plain = load_file(str(tmp_path / "raw" / "model.safetensors")), _exported(tmp_path / "plain")
    assert all(torch.equal(ema[k], final[k]) for k in final)  # the run's final/ is the last step's average
    assert all(torch.equal(raw[k], plain[k]) for k in plain)  # the trained weights, as the run without it
    assert not torch.equal(ema["model.embed_tokens.weight"], raw["model.embed_tokens.weight"])
    def recorded(directory: Path) -> object:
        return json.loads((directory / "config.json").read_text(encoding="utf-8")).get("csbp_weights")

    averaged = {"kind": "ema", "ema_decay": DECAY, "ema_updates": 4}
    assert recorded(tmp_path / "run" / "final") == recorded(tmp_path / "ema") == averaged
    assert recorded(tmp_path / "raw") == {**averaged, "kind": "trained"}
    assert recorded(tmp_path / "plain" / "final") is None  # a run without an average: its weights, as always
    plain_checkpoint = tmp_path / "plain" / "checkpoints" / "step_0000004"
    capsys.readouterr()
    assert csbp_main(["export", str(plain_checkpoint), "--out", str(tmp_path / "none"), "--weights", "ema"]) == 2
    err = capsys.readouterr().err
    assert "--weights ema: " in err and "has no weight average (its run had no optim.ema_decay)" in err
    # a drafter's checkpoint never has one: the fix is csbp dflash export, not "drop --weights" and then that
    drafter = tmp_path / "drafter" / "step_0000004"
    shutil.copytree(plain_checkpoint, drafter)
    state = json.loads((drafter / "trainer_state.json").read_text())
    state["config_yaml"] = yaml.safe_dump(with_changes(dflash_changes()))
    (drafter / "trainer_state.json").write_text(json.dumps(state))
    assert csbp_main(["export", str(drafter), "--out", str(tmp_path / "d"), "--weights", "ema"]) == 2
    assert "is a DFlash drafter checkpoint (fix: csbp dflash export --checkpoint" in capsys.readouterr().err


@pytest.mark.parametrize(("changes", "message"), [
    ({"optim.ema_decay": 1.0}, r"optim\.ema_decay"),
    ({"optim.ema_decay": 0.0}, r"optim\.ema_decay"),
])
def test_a_decay_outside_zero_one_is_refused(artifact: Path, changes: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        tiny_config(artifact, **changes)


def _fsdp_runs(rank: int, world: int, artifact: str, root: str) -> list[Any]:
    common = {"topology.dp": 2, "train.micro_batch_size": 1, "train.save_every": 0, **AVERAGED}  # a save reshards too
    fsdp = {"train.fsdp": True}
    train(tiny_config(Path(artifact), **common), run_dir=Path(root) / "dp")
    train(tiny_config(Path(artifact), **common, **fsdp), run_dir=Path(root) / "fsdp")
    train(tiny_config(Path(artifact), **{**common, "optim.ema_decay": None, "train.fsdp": True}),
          run_dir=Path(root) / "fsdp-plain")
    # a resume that switches FSDP on reads the replicated average into shards, one that switches it off the reverse
    for name, before, after in (("dp-then-fsdp", {}, fsdp), ("fsdp-then-dp", fsdp, {})):
        train(tiny_config(Path(artifact), **common, **before), run_dir=Path(root) / name, max_steps=2)
        train(tiny_config(Path(artifact), **common, **after), run_dir=Path(root) / name, resume=True)
    return []


@pytest.mark.multiprocess
def test_under_fsdp_the_average_matches_data_parallelism_and_never_reaches_training(
    artifact: Path, tmp_path: Path
) -> None:
    """Also across a resume that switches FSDP on or off: DCP reshards the average with the weights (a
    resumed average restarted from the weights, or one left unloaded, would change step 4's validation
    and the export)."""
    run_local(_fsdp_runs, 2, (str(artifact), str(tmp_path)), timeout_s=300)
    fsdp, plain = metric_rows(tmp_path / "fsdp"), metric_rows(tmp_path / "fsdp-plain")
    assert [r.get("loss") for r in fsdp] == [r.get("loss") for r in plain]
    dp = metric_rows(tmp_path / "dp")
    validated = [r["step"] for r in fsdp if "val_loss" in r]
    assert validated == [r["step"] for r in dp if "val_loss" in r] and len(validated) > 2
    assert [r["val_loss"] for r in fsdp if "val_loss" in r] == pytest.approx(
        [r["val_loss"] for r in dp if "val_loss" in r], rel=1e-5)
    reference = _exported(tmp_path / "dp")
    for run in ("fsdp", "dp-then-fsdp", "fsdp-then-dp"):
        exported = _exported(tmp_path / run)
        for name, value in reference.items():
            torch.testing.assert_close(exported[name], value, rtol=1e-5, atol=1e-6)
        assert [r["val_loss"] for r in metric_rows(tmp_path / run) if "val_loss" in r] == pytest.approx(
            [r["val_loss"] for r in dp if "val_loss" in r], rel=1e-5)


def test_the_memory_bound_and_the_planner_count_the_averages_copy(artifact: Path) -> None:
    from csbp.plan.calibration import packaged_calibration
    from csbp.plan.hardware import hardware
    from csbp.plan.layout import Layout
    from csbp.plan.model import predict
    from csbp.plan.run_config_workload import run_config_workload
    from csbp.training.memory_fit import check_state_fits, state_bytes
    from csbp.training.preflight import check_run

    cfg = tiny_config(artifact, **AVERAGED)
    inputs = check_run(cfg, check_device=False)
    n = inputs.decoder_config.num_parameters()
    assert state_bytes(inputs, fp64=False, shards=1, averaged=True) == 20 * n
    with pytest.raises(ValueError, match=r"AdamW state and the weight average, .*or optim\.ema_decay: null"):
        check_state_fits(cfg, inputs, local_ranks=1, memory=18 * n)
    hw, cal = hardware("h200", gpus=4), packaged_calibration("h200")
    with_average, without = run_config_workload(cfg), run_config_workload(tiny_config(artifact))
    for sharding, shards in (("fsdp2", 4), ("ddp", 1)):
        layout = Layout(4, 1, 1, sharding=sharding)
        terms = predict(with_average, layout, 32, hw, cal).mem_terms
        assert terms["weight average"] == 4 * with_average.model.total_params / shards
        assert "weight average" not in predict(without, layout, 32, hw, cal).mem_terms


def test_a_drafter_has_no_weight_average() -> None:
    from test_config import error_lines

    lines = error_lines(with_changes({**dflash_changes(), "optim.ema_decay": 0.999}))
    assert any("optim.ema_decay: a DFlash drafter is exported and evaluated with its trained weights" in line
               for line in lines), lines
