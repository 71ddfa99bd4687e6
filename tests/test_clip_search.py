"""BD3-LM's noise-window search (``objective.clip_search_widths``, ``csbp.training.clip_search``).

* The candidate windows: the configured one, then each width's windows stepped by ``delta``, lower
  ends raised to the NELBO's floor (bd3lms' grid: 35 windows for its widths 0.5..0.9 at 0.05).
* The variances against the reference recipe written out independently: each candidate's batches
  corrupted from the same generator, a plain forward over ``[x_t ; x_0]``, per-token ``weight · CE``
  with ``F.cross_entropy``, the mean over each block's ``B`` positions, ``torch.var`` over a batch's
  (sample, block) values, summed over batches; float64, 1e-12 relative. (Several ranks against one
  process: ``tests/test_validation_over_layouts.py``.)
* In training: the window chosen at a validation is the one the next steps' noise levels come from,
  it is logged and saved in the checkpoint, a resumed run trains on it (bit-identical to the
  uninterrupted run), and ``val_loss`` keeps scoring the configured window.
* Refusals: another objective, widths outside ``(0, 1]``, a delta without widths, no validation.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from csbp.config import ConfigError
from csbp.data.artifact import open_artifact
from csbp.engine.block_diffusion import (
    DocumentPlanner,
    build_rank_plan,
    rank_block_losses,
    rank_inputs,
    rank_loss,
    sample_rows,
)
from csbp.engine.context import single_process_context
from csbp.engine.verify import tiny_model_config
from csbp.models.decoder import Decoder
from csbp.objectives import build_objective
from csbp.objectives.base import corruption_generator
from csbp.training import step as step_module
from csbp.training import train
from csbp.training.clip_search import (
    CLIP_SEARCH_MICRO_STEP,
    SEARCH_FLOOR,
    clip_candidates,
    search_clip_window,
)
from csbp.training.preflight import check_run
from csbp.training.step import EVAL_MICRO_STEP, StepRunner, validation_loader
from test_training_run import make_artifact, metric_rows, tiny_config, trajectory

SEQ_LEN, BLOCK, ROWS, BATCHES, SEED = 32, 4, 3, 2, 7


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_artifact(tmp_path_factory.mktemp("data") / "art", seq_len=SEQ_LEN)


def test_the_candidates_are_the_configured_window_then_each_widths_steps() -> None:
    assert clip_candidates([0.5], 0.25, (0.3, 0.8)) == ((0.3, 0.8), (SEARCH_FLOOR, 0.5), (0.25, 0.75), (0.5, 1.0))
    assert clip_candidates([1.0, 0.5], 0.5, (SEARCH_FLOOR, 1.0)) == ((SEARCH_FLOOR, 1.0), (SEARCH_FLOOR, 0.5), (0.5, 1.0))
    grid = clip_candidates([0.5, 0.6, 0.7, 0.8, 0.9], 0.05, (SEARCH_FLOOR, 1.0))
    assert len(grid) == 1 + 11 + 9 + 7 + 5 + 3 and len(set(grid)) == len(grid)
    assert all(SEARCH_FLOOR <= low < high <= 1.0 for low, high in grid)
    assert (0.45, 0.95) in grid and (0.4, 0.9) in grid  # steps of 0.05 land on round numbers


def _reference_variances(model: Decoder, artifact: Path, candidates: tuple) -> list[float]:
    """bd3lms' recipe, written out: per batch, torch.var over every (sample, block) mean NLL."""
    data = open_artifact(artifact)
    ctx = single_process_context()
    plan = build_rank_plan(ctx, SEQ_LEN, BLOCK)
    loader = validation_loader(data.split("val"), micro_batch_size=ROWS, seed=SEED, ctx=ctx)
    base = build_objective("bd3", mask_token_id=data.mask_token_id, block_size=BLOCK)
    totals = [0.0] * len(candidates)
    for index in range(BATCHES):
        batch = next(loader)
        for slot, (low, high) in enumerate(candidates):
            corrupted = replace(base, t_min=low, t_max=high).corrupt(
                batch, corruption_generator(SEED, index, 0, micro_step=CLIP_SEARCH_MICRO_STEP)
            )
            ids, positions = rank_inputs(corrupted, plan)
            with torch.no_grad():
                logits = model.logits(model(ids, positions, plan.attention)[:, :SEQ_LEN])
            logits[..., corrupted.exclude_token] = float("-inf")
            labels = corrupted.labels
            ce = F.cross_entropy(logits.flatten(0, 1), labels.clamp(min=0).flatten(), reduction="none").view_as(labels)
            nll = torch.where(labels != -100, ce * corrupted.weights.double(), 0.0)
            totals[slot] += float(nll.view(ROWS, SEQ_LEN // BLOCK, BLOCK).mean(-1).var())
    return totals


def test_the_variances_are_the_reference_recipes(artifact: Path) -> None:
    data = open_artifact(artifact)
    model = Decoder(replace(tiny_model_config(), vocab_size=data.vocab_size), dtype=torch.float64, seed=1)
    ctx = single_process_context()
    runner = StepRunner(
        model, build_objective("bd3", mask_token_id=data.mask_token_id, block_size=BLOCK),
        build_rank_plan(ctx, SEQ_LEN, BLOCK), ctx, device=torch.device("cpu"), precision="fp64", seed=SEED,
        ce_chunk_rows=5,  # several chunks per micro-batch
    )
    candidates = clip_candidates([0.3, 0.7], 0.2, (0.2, 0.6))
    result = search_clip_window(runner, data.split("val"), micro_batch_size=ROWS, num_batches=BATCHES,
                                candidates=candidates)
    expected = _reference_variances(model, artifact, candidates)
    assert [result.variances[w] for w in candidates] == pytest.approx(expected, rel=1e-12)
    assert result.window == candidates[expected.index(min(expected))]
    assert runner.model.training  # left as it was found


def test_block_losses_add_up_to_each_samples_training_numerator_with_packed_documents(artifact: Path) -> None:
    """With packed documents every sample runs its own plan; each sample's block losses sum to the
    weighted cross-entropy ``rank_loss`` computes for it (its own per-sample loop, checked for
    exactness elsewhere)."""
    data = open_artifact(artifact)
    model = Decoder(replace(tiny_model_config(), vocab_size=data.vocab_size), dtype=torch.float64, seed=1)
    planner = DocumentPlanner(single_process_context(), SEQ_LEN, BLOCK)
    batch = next(validation_loader(data.split("val"), micro_batch_size=ROWS, seed=SEED, ctx=single_process_context()))
    corrupted = build_objective("bd3", mask_token_id=data.mask_token_id, block_size=BLOCK).corrupt(
        batch, corruption_generator(SEED, 0, 0)
    )
    assert any(len(set(row.tolist())) > 1 for row in corrupted.doc_ids)  # several documents in a row
    blocks = rank_block_losses(model, corrupted, planner, ce_chunk_rows=7)
    assert blocks.shape == (ROWS, SEQ_LEN // BLOCK)
    for index in range(ROWS):
        one = sample_rows(corrupted, slice(index, index + 1))
        _, numerator = rank_loss(model, one, planner, global_denominator=1.0, world_size=1)
        assert float(blocks[index].sum()) == pytest.approx(float(numerator), rel=1e-12)


def test_training_moves_to_the_chosen_window_saves_it_and_resumes_on_it(
    artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    changes = {"objective.t_min": 0.2, "objective.t_max": 0.4, "objective.clip_search_widths": [0.5],
               "objective.clip_search_delta": 0.25}
    levels: dict[int, list[float]] = {}  # training step -> the noise levels its micro-batches drew
    scored: set[float] = set()  # the t_min of every window val_loss was scored under
    real = step_module.StepRunner._corrupt_on_host

    def recording(self, batch, step, micro_step, objective=None):  # type: ignore[no-untyped-def]
        corrupted = real(self, batch, step, micro_step, objective)
        if micro_step < 2:  # a training micro-step, not a validation slot
            levels.setdefault(step, []).extend(corrupted.noise_levels.flatten().tolist())
        if micro_step == EVAL_MICRO_STEP:  # val_loss's corruption
            scored.add((objective or self.objective).t_min)
        return corrupted

    monkeypatch.setattr(step_module.StepRunner, "_corrupt_on_host", recording)
    train(tiny_config(artifact, **changes), run_dir=tmp_path / "full")
    rows = {row["step"]: row for row in metric_rows(tmp_path / "full")}
    chosen = (rows[2]["val_clip_t_min"], rows[2]["val_clip_t_max"])
    assert chosen != (0.2, 0.4) and chosen in clip_candidates([0.5], 0.25, (0.2, 0.4))
    assert all(0.2 <= t <= 0.4 for step in (1, 2) for t in levels[step])  # the configured window until step 2
    assert all(chosen[0] <= t <= chosen[1] for t in levels[3])  # the chosen window from step 3 on
    assert not all(0.2 <= t <= 0.4 for t in levels[3])
    state = json.loads((tmp_path / "full" / "checkpoints" / "step_0000002" / "trainer_state.json").read_text())
    assert tuple(state["clip_window"]) == chosen
    train(tiny_config(artifact, **changes), run_dir=tmp_path / "half", max_steps=2)
    train(tiny_config(artifact, **changes), run_dir=tmp_path / "half", resume=True)
    assert trajectory(tmp_path / "half") == trajectory(tmp_path / "full")
    assert scored == {0.2}  # val_loss scores the configured window throughout: its curve stays comparable


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"objective.name": "mdlm", "objective.block_size": None, "objective.clip_search_widths": [0.5]},
         r"objective\.clip_search_widths: searches bd3's noise window; mdlm has none to search"),
        ({"objective.clip_search_widths": [0.5, 0.0]}, r"widths \[0\.0\] are not in \[0\.01, 1\]"),
        ({"objective.clip_search_widths": [1.5]}, r"widths \[1\.5\] are not in \[0\.01, 1\]"),
        # narrower than the 0.001 floor lets through: no window at all, the configured one silently kept
        ({"objective.clip_search_widths": [1e-300]}, r"widths \[1e-300\] are not in \[0\.01, 1\]"),
        ({"objective.clip_search_delta": 0.1}, r"clip_search_delta: has no effect without objective\.clip_search_widths"),
        ({"objective.clip_search_delta": 0.0, "objective.clip_search_widths": [0.5]}, r"clip_search_delta"),
    ],
)
def test_settings_the_search_cannot_use_are_refused(artifact: Path, changes: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        tiny_config(artifact, **changes)


def test_a_search_without_validation_is_refused_before_training(artifact: Path) -> None:
    tiny_config(artifact, **{"objective.clip_search_widths": [1.0]})  # 1.0: the whole range, accepted
    with pytest.raises(ValueError, match=r"objective\.clip_search_widths: the noise window is searched at validation, "
                                         r"but train\.eval_every is 0 \(fix: set train\.eval_every > 0"):
        check_run(tiny_config(artifact, **{"objective.clip_search_widths": [0.5], "train.eval_every": 0}))


@pytest.mark.parametrize("window", [[0.5], [0.6, 0.5], [0.0, 1.5], ["0.1", 0.5], True, [True, 0.5]])
def test_a_checkpoint_whose_clip_window_is_no_noise_window_is_refused(tmp_path: Path, window: object) -> None:
    from csbp.training.checkpoint import TrainingState

    state = TrainingState(step=2, scheduler={}, loader={}, rng={}, data_fingerprint="f", param_shapes={},
                          topology={}, config_yaml="", clip_window=[0.5, 1.0])
    assert TrainingState.from_json(state.to_json(), tmp_path).clip_window == [0.5, 1.0]
    assert TrainingState.from_json({**state.to_json(), "clip_window": None}, tmp_path).clip_window is None
    with pytest.raises(ValueError, match=r"clip_window is .*not a noise window \[t_min, t_max\]; the checkpoint is corrupt"):
        TrainingState.from_json({**state.to_json(), "clip_window": window}, tmp_path)


def test_a_run_stopped_between_validations_resumes_on_the_uninterrupted_window(artifact: Path, tmp_path: Path) -> None:
    """An invocation validates at its last step also off the ``train.eval_every`` schedule (``--max-steps
    1`` here); searching there moved the window a step early, and the resumed run trained step 2 on a
    window the uninterrupted one had not chosen yet. The search runs on the schedule's validations only.
    (Step 1's own ``val_loss``, logged only by the stopped invocation, is not part of the comparison.)"""
    changes = {"objective.t_min": 0.2, "objective.t_max": 0.4, "objective.clip_search_widths": [0.5],
               "objective.clip_search_delta": 0.25}
    train(tiny_config(artifact, **changes), run_dir=tmp_path / "full")
    train(tiny_config(artifact, **changes), run_dir=tmp_path / "half", max_steps=1)
    assert "val_clip_t_min" not in metric_rows(tmp_path / "half")[-1]  # step 1 is no scheduled validation
    state = json.loads((tmp_path / "half" / "checkpoints" / "step_0000001" / "trainer_state.json").read_text())
    assert state["clip_window"] == [0.2, 0.4]
    train(tiny_config(artifact, **changes), run_dir=tmp_path / "half", resume=True)

    def updates(run_dir: Path) -> list[tuple]:
        return [(row["step"], row.get("loss"), row.get("grad_norm"), row.get("val_clip_t_min")) for row in metric_rows(run_dir)]

    assert updates(tmp_path / "half") == updates(tmp_path / "full")


def test_a_checkpoint_or_comparison_from_before_the_search_resumes(artifact: Path, tmp_path: Path) -> None:
    """A config recorded before ``objective.clip_search_widths`` and ``clip_search_delta`` existed lacks
    them: it trained without a search, which is what their defaults do, so resuming it is no change
    (read as ``null`` they refused every older checkpoint, with a fix setting them to ``null``)."""
    from csbp.compare.runner import _check_same_config
    from csbp.config.loading import dump_config
    from csbp.training.resume_config import flat_config, resume_changes

    cfg = tiny_config(artifact)
    older = "\n".join(line for line in dump_config(cfg).splitlines()
                       if not any(added in line for added in ("clip_search", "resample", "ema_decay")))  # later fields
    assert resume_changes(older, cfg, tmp_path, 2) == []
    searching = tiny_config(artifact, **{"objective.clip_search_widths": [0.5]})
    with pytest.raises(ValueError, match=r"trained with objective\.clip_search_widths=\[\], the config sets \[0\.5\]"):
        resume_changes(older, searching, tmp_path, 2)
    recorded = cfg.model_dump(mode="json")
    for name in ("clip_search_widths", "clip_search_delta", "resample"):
        del recorded["objective"][name]
    del recorded["optim"]["ema_decay"]
    assert "objective.clip_search_delta" not in flat_config(recorded)
    _check_same_config(recorded, cfg.model_dump(mode="json"), tmp_path)  # a comparison started before them


def test_csbp_compare_refuses_the_search_naming_it(artifact: Path) -> None:
    """``csbp compare`` validates at its time points with ``train.eval_every: 0``: the search has no schedule
    there (and would move each layout's window at other steps). It was refused by the trainer's check, whose
    fix (set ``train.eval_every > 0``) a comparison cannot follow; compare refuses it in its own words."""
    from csbp.compare.layouts import layout_config

    cfg = tiny_config(artifact, **{"objective.clip_search_widths": [0.5], "train.grad_accum": 1})
    with pytest.raises(ValueError, match=r"^objective\.clip_search_widths: csbp compare .*\(fix: remove "
                                         r"objective\.clip_search_widths"):
        layout_config(cfg, "cp", 2)


def test_a_delta_too_fine_to_search_is_refused_naming_it(artifact: Path) -> None:
    """``clip_search_delta: 1e-300`` validated, then every rank hung building ~1e300 candidate windows
    after the launch; more than 1000 windows (bd3lms' grid has 36) is refused in one line."""
    tiny_config(artifact, **{"objective.clip_search_widths": [0.5], "objective.clip_search_delta": 0.001})  # 501
    with pytest.raises(ConfigError, match=r"objective\.clip_search_delta: 1e-300 gives more than 1000 candidate "
                                          r"windows for widths \[0\.5\]"):
        tiny_config(artifact, **{"objective.clip_search_widths": [0.5], "objective.clip_search_delta": 1e-300})



def test_packed_documents_are_planned_once_per_batch_not_per_window(
    artifact: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every candidate corrupts the same rows, so their documents, hence their plans, are the batch's: they
    are built once per validation batch and shared by every window (they were rebuilt per window: 12 windows
    of one 4 x 1024-token batch of the tiny model took 1.89 s on the CPU, 1.06 s with the plans shared)."""
    data = open_artifact(artifact)
    ctx = single_process_context()
    model = Decoder(replace(tiny_model_config(), vocab_size=data.vocab_size), dtype=torch.float64, seed=1)
    runner = StepRunner(
        model, build_objective("bd3", mask_token_id=data.mask_token_id, block_size=BLOCK),
        DocumentPlanner(ctx, SEQ_LEN, BLOCK), ctx, device=torch.device("cpu"), precision="fp64", seed=SEED,
        ce_chunk_rows=64,
    )
    candidates = clip_candidates([0.5], 0.25, (SEARCH_FLOOR, 1.0))
    calls = []
    real = DocumentPlanner.plans_for
    monkeypatch.setattr(DocumentPlanner, "plans_for", lambda self, doc_ids: calls.append(1) or real(self, doc_ids))
    search_clip_window(runner, data.split("val"), micro_batch_size=ROWS, num_batches=BATCHES, candidates=candidates)
    assert len(calls) == BATCHES


def test_when_no_window_has_a_finite_variance_training_stays_on_its_window(
    artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A non-finite validation loss makes every variance non-finite: the search's fallback is its first
    candidate (the configured window), but a run that had moved keeps the window it trains on."""
    from csbp.training import step_loop
    from csbp.training.clip_search import ClipSearchResult

    answers = iter([(0.5, 1.0), None])  # the first search moves to [0.5, 1]; the second sees only NaN

    def search(runner, split, *, micro_batch_size, num_batches, candidates):  # type: ignore[no-untyped-def]
        window = next(answers)
        if window is None:
            return ClipSearchResult(candidates[0], {w: float("nan") for w in candidates})
        return ClipSearchResult(window, {w: (0.0 if w == window else 1.0) for w in candidates})

    monkeypatch.setattr(step_loop, "search_clip_window", search)
    changes = {"objective.clip_search_widths": [0.5], "objective.clip_search_delta": 0.25, "train.save_every": 0}
    train(tiny_config(artifact, **changes), run_dir=tmp_path / "run")
    rows = {row["step"]: row for row in metric_rows(tmp_path / "run")}
    assert (rows[2]["val_clip_t_min"], rows[4]["val_clip_t_min"]) == (0.5, 0.5)
    state = json.loads((tmp_path / "run" / "checkpoints" / "step_0000004" / "trainer_state.json").read_text())
    assert state["clip_window"] == [0.5, 1.0]
