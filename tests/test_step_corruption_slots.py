"""The corruption seeding ``csbp.training.step`` documents, checked from outside: micro-step ``k`` of
step ``s`` draws from ``corruption_generator(seed, s, dp_rank, micro_step=k)``, validation batch ``i``
from ``(seed, i, dp_rank, EVAL_MICRO_STEP)`` and its unclipped-NELBO corruption from the
``NELBO_MICRO_STEP`` slot; the validation rows are each replica's own, unshuffled, the same every time.

A mutation audit found these unguarded: every micro-step sharing slot 0 (gradient accumulation would
then train ``grad_accum`` copies of one mask pattern), every validation batch drawing index 0's noise,
the NELBO reusing the validation noise, and a shuffled or replica-blind validation loader.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from csbp.data.artifact import open_artifact
from csbp.training import step as step_module
from csbp.training import train
from csbp.training.step import EVAL_MICRO_STEP, NELBO_MICRO_STEP, validation_loader
from test_training_run import make_artifact, tiny_config


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_artifact(tmp_path_factory.mktemp("data") / "art")


def test_each_micro_step_and_validation_batch_draws_its_own_documented_slot(
    artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    drawn: list[tuple[int, int, int, int]] = []
    real = step_module.corruption_generator

    def recording(seed: int, step: int, dp_rank: int, *, micro_step: int = 0):  # type: ignore[no-untyped-def]
        drawn.append((seed, step, dp_rank, micro_step))
        return real(seed, step, dp_rank, micro_step=micro_step)

    monkeypatch.setattr(step_module, "corruption_generator", recording)
    cfg = tiny_config(artifact, **{"train.max_steps": 2, "train.eval_every": 2, "train.eval_batches": 2,
                                   "train.save_every": 0, "run.seed": 7})
    train(cfg, run_dir=tmp_path / "run")
    validation = [
        (7, batch, 0, slot) for batch in range(2) for slot in (EVAL_MICRO_STEP, NELBO_MICRO_STEP)
    ]
    training = [(7, step, 0, micro) for step in (1, 2) for micro in range(cfg.train.grad_accum)]
    # the untrained baseline's validation, steps 1 and 2, then the validation at step 2
    assert drawn == validation + training + validation
    assert cfg.train.grad_accum == 2 and len(set(drawn)) == len(validation) + len(training)


def test_the_validation_rows_are_each_replicas_own_unshuffled_and_fixed(artifact: Path) -> None:
    split = open_artifact(artifact).split("train")

    def rows(dp_rank: int) -> list[int]:
        ctx = SimpleNamespace(coords=SimpleNamespace(dp_rank=dp_rank), topology=SimpleNamespace(dp=2))
        loader = validation_loader(split, micro_batch_size=2, seed=3, ctx=ctx)  # type: ignore[arg-type]
        return [int(row) for _ in range(3) for row in next(loader)["row_ids"]]

    first, second = rows(0), rows(1)
    assert first == rows(0) and second == rows(1)  # the same batches at every evaluation
    assert not set(first) & set(second)  # each replica scores its own rows
    assert first == sorted(first) and second == sorted(second)  # the split's order: no shuffle
