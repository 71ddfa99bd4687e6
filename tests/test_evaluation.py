"""Likelihood evaluation: the exact left-to-right NLL against a per-token brute force, the unclipped
NELBO's closed form for a uniform predictor, ``val_nelbo`` across a CSBP layout, and ``csbp eval``
end to end with its fail-closed messages."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from csbp.cli.main import main
from csbp.engine.block_diffusion import rank_loss
from csbp.engine.context import build_parallel_context, single_process_context
from csbp.engine.verify import MASK_TOKEN_ID, VOCAB_SIZE, tiny_model_config
from csbp.evaluation import EVAL_T_MIN, EvalSettings, left_to_right_batches, nelbo_objective
from csbp.evaluation.runner import eval_plan
from csbp.generation.forward import RecomputeBlockForward
from csbp.models.decoder import Decoder
from csbp.models.hf_io import export_hf_checkpoint
from csbp.objectives import build_objective, corruption_generator
from csbp.parallel.launch import run_local
from csbp.training import train
from csbp.training.metrics import read_metrics
from csbp.training.preflight import check_run
from csbp.training.step import StepRunner
from csbp.training.trainer import rank_plan_for
from test_training_run import make_artifact, tiny_config

SEQ_LEN = 16


def _batch(seed: int = 0, samples: int = 2) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, MASK_TOKEN_ID, (samples, SEQ_LEN), generator=generator)
    loss_mask = torch.ones_like(ids, dtype=torch.bool)
    loss_mask[1, 5] = False  # an unsupervised token conditions but is never scored
    return {"input_ids": ids, "loss_mask": loss_mask}


def _brute_force_nll(model: Decoder, batch: dict[str, torch.Tensor], block_size: int, token_shift: bool) -> float:
    """``-log p(x)`` of left-to-right sampling, one sampler forward (``RecomputeBlockForward``) per token."""
    total = 0.0
    for ids, supervised in zip(batch["input_ids"], batch["loss_mask"], strict=True):
        for position in range(SEQ_LEN):
            if not supervised[position] or (token_shift and position == 0):
                continue
            block, offset = divmod(position, block_size)
            start = block * block_size
            forward = RecomputeBlockForward(model, block_size)
            forward.prefill([ids[:start].tolist()])
            block_ids = ids[start : start + block_size].clone()
            block_ids[offset:] = torch.where(supervised[start + offset : start + block_size], MASK_TOKEN_ID, block_ids[offset:])
            hidden_1BD = forward.denoise(block_ids[None], [start])
            if token_shift:
                row_D = hidden_1BD[0, offset - 1] if offset > 0 else forward.clean_row_before([0])[0]
            else:
                row_D = hidden_1BD[0, offset]
            logits_V = model.logits(row_D[None])[0].clone()
            logits_V[MASK_TOKEN_ID] = float("-inf")
            total -= float(torch.log_softmax(logits_V, dim=-1)[ids[position]])
    return total


@pytest.mark.parametrize(("objective", "block_size"), [("bd3", 4), ("fast_dllm_v2", 4), ("mdlm", SEQ_LEN)])
def test_left_to_right_nll_equals_the_per_token_chain_rule(objective: str, block_size: int) -> None:
    model = Decoder(tiny_model_config(), dtype=torch.float64, seed=0).eval()
    settings = EvalSettings(objective=objective, block_size=block_size, mask_token_id=MASK_TOKEN_ID)
    plan = eval_plan(settings, SEQ_LEN, single_process_context())
    batch = _batch()
    total, forwards = 0.0, 0
    with torch.no_grad():
        for corrupted in left_to_right_batches(
            batch, mask_token_id=MASK_TOKEN_ID, block_size=block_size,
            token_shift=settings.token_shift, uses_clean_stream=settings.uses_clean_stream,
        ):
            total += float(rank_loss(model, corrupted, plan, global_denominator=1.0, world_size=1)[1])
            forwards += 1
        reference = _brute_force_nll(model, batch, block_size, settings.token_shift)
    assert forwards == block_size
    assert total == pytest.approx(reference, rel=1e-10)


@pytest.mark.parametrize("objective", ["bd3", "mdlm", "fast_dllm_v2"])
def test_uniform_predictor_nelbo_is_log_v_minus_one(objective: str) -> None:
    """A zero LM head is uniform over the ``V - 1`` non-mask ids, so every masked CE is ``log(V - 1)``
    and one draw's NELBO is ``log(V - 1) · Σ w / Z``; since ``E[m/t] = 1`` for any ``t`` range, its
    expectation is exactly ``log(V - 1)`` (checked over many draws within 4 standard errors)."""
    model = Decoder(tiny_model_config(), dtype=torch.float64, seed=0).eval()
    with torch.no_grad():
        model.lm_head_weight.zero_()
    block_size = SEQ_LEN if objective == "mdlm" else 4
    settings = EvalSettings(objective=objective, block_size=block_size, mask_token_id=MASK_TOKEN_ID)
    nelbo = nelbo_objective(settings.build_objective())
    assert nelbo is not None
    plan = eval_plan(settings, SEQ_LEN, single_process_context())
    log_v = math.log(VOCAB_SIZE - 1)
    batch = _batch(samples=4)
    estimates = []
    for draw in range(400):
        corrupted = nelbo.corrupt(batch, corruption_generator(0, 0, 0, micro_step=draw))
        ratio = float(corrupted.weights.double().sum()) / corrupted.denominator()
        estimates.append(log_v * ratio)
        if draw < 2:
            with torch.no_grad():
                ce_sum = rank_loss(model, corrupted, plan, global_denominator=1.0, world_size=1)[1]
            assert float(ce_sum) / corrupted.denominator() == pytest.approx(log_v * ratio, rel=1e-12)
            assert float(corrupted.noise_levels.min()) >= EVAL_T_MIN
    values = torch.tensor(estimates, dtype=torch.float64)
    stderr = float(values.std()) / math.sqrt(len(estimates))
    assert abs(float(values.mean()) - log_v) < 4 * stderr


def _validation_metrics(rank: int, world: int, artifact: Path, changes: dict[str, Any]) -> dict[str, float] | None:
    """``StepRunner.evaluate`` of a float64 model on this rank of ``changes``' topology."""
    cfg = tiny_config(artifact, **changes)
    inputs = check_run(cfg)
    ctx = build_parallel_context(cfg.topology.to_topology()) if world > 1 else single_process_context()
    model = Decoder(inputs.decoder_config, dtype=torch.float64, seed=0)
    runner = StepRunner(
        model, inputs.build_objective(), rank_plan_for(cfg, ctx), ctx,
        device=torch.device("cpu"), precision="fp64", seed=0, ce_chunk_rows=64,
    )
    assert inputs.val_split is not None
    result = runner.evaluate(inputs.val_split, micro_batch_size=2, num_batches=2)
    return {"loss": result.loss, **result.metrics} if rank == 0 else None


CLIPPED = {"objective.t_min": 0.3, "objective.t_max": 0.8, "data.seq_len": 32}


@pytest.mark.multiprocess
@pytest.mark.slow
def test_validation_nelbo_is_the_same_under_a_csbp_layout(tmp_path: Path) -> None:
    artifact = make_artifact(tmp_path / "art")
    single = _validation_metrics(0, 1, artifact, CLIPPED)
    csbp = run_local(_validation_metrics, 2, (artifact, {**CLIPPED, "topology.cp": 2, "topology.bp": 2}), timeout_s=240)[0]
    assert single is not None and csbp is not None
    assert set(single) == {"loss", "nelbo", "ppl_bound"}
    assert csbp["nelbo"] == pytest.approx(single["nelbo"], rel=1e-10)
    assert csbp["loss"] == pytest.approx(single["loss"], rel=1e-10)
    assert single["ppl_bound"] == pytest.approx(math.exp(single["nelbo"]))
    assert abs(single["nelbo"] - single["loss"]) > 1e-3  # the clipped loss is another number


def test_ar_has_no_nelbo() -> None:
    assert nelbo_objective(build_objective("ar")) is None


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    """A 2-step tiny bd3 run (clipped noise, as the demo), its artifact and its end-of-run summary."""
    root = tmp_path_factory.mktemp("eval")
    artifact = make_artifact(root / "art")
    cfg = tiny_config(artifact, **{"train.max_steps": 2, "objective.t_min": 0.3, "objective.t_max": 0.8})
    summary = train(cfg, run_dir=root / "run")
    return root / "run", artifact, summary.format()


def test_training_logs_val_nelbo(trained: tuple[Path, Path, str]) -> None:
    run_dir, _, summary = trained
    assert "val nelbo   first" in summary and summary.splitlines()[-1].startswith("val_loss: ")
    validated = [r for r in read_metrics(run_dir / "metrics.jsonl") if "val_loss" in r]
    assert validated and all(math.isfinite(r["val_nelbo"]) for r in validated)
    assert all(r["val_ppl_bound"] == pytest.approx(math.exp(r["val_nelbo"])) for r in validated)


def test_csbp_eval_end_to_end(trained: tuple[Path, Path, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir, artifact, _ = trained
    out = tmp_path / "eval.json"
    args = ["eval", "--model", str(run_dir / "final"), "--data", str(artifact), "--samples", "3", "--micro-batch-size", "2"]
    assert main([*args, "--json", str(out), "--max-batches", "2"]) == 0
    printed = capsys.readouterr().out
    assert "nelbo" in printed and "ltr nll" in printed
    report = json.loads(out.read_text())
    assert (report["objective"], report["block_size"], report["batches"], report["rows"]) == ("bd3", 4, 2, 4)
    # the mask and window it scored with, as trained (they were in neither the header nor the JSON)
    assert (report["document_mask"], report["window"]) == (False, None)
    assert "bd3 B=4, no document mask, full attention" in printed
    assert report["nelbo_stderr"] > 0 and report["ppl_bound"] == pytest.approx(math.exp(report["nelbo"]))
    assert report["ltr_tokens"] == report["nelbo_tokens"] == 4 * 32
    assert math.isfinite(report["ltr_nll"])
    # the same seed gives the same numbers
    assert main([*args, "--json", str(out), "--max-batches", "2", "--no-ltr"]) == 0
    again = json.loads(out.read_text())
    assert again["nelbo"] == report["nelbo"] and again["ltr_nll"] is None
    capsys.readouterr()


@pytest.mark.multiprocess
@pytest.mark.slow
def test_csbp_eval_on_a_csbp_layout_equals_one_process(
    trained: tuple[Path, Path, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir, artifact, _ = trained
    args = ["eval", "--model", str(run_dir / "final"), "--data", str(artifact), "--samples", "2",
            "--micro-batch-size", "2", "--max-batches", "3", "--dtype", "float64"]
    reports = []
    for layout in ([], ["--cp", "2", "--bp", "2"], ["--nproc", "2"]):  # --nproc defaults to max(--cp, --bp)
        out = tmp_path / f"eval{len(reports)}.json"
        assert main([*args, *layout, "--json", str(out)]) == 0
        reports.append(json.loads(out.read_text()))
    capsys.readouterr()
    single = reports[0]
    for report in reports[1:]:
        assert (report["rows"], report["nelbo_tokens"], report["ltr_tokens"]) == (6, 6 * 32, 6 * 32)
        for key in ("nelbo", "nelbo_stderr", "ltr_nll"):
            assert report[key] == pytest.approx(single[key], rel=1e-10), key


def test_csbp_eval_takes_the_trained_block_size_under_another_blockwise_objective(
    trained: tuple[Path, Path, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--objective fast_dllm_v2 --allow-objective-change`` on a bd3 run asked for ``--block-size`` though the
    run records the block size it trained with."""
    run_dir, artifact, _ = trained
    out = tmp_path / "eval.json"
    assert main(["eval", "--model", str(run_dir / "final"), "--data", str(artifact), "--samples", "1",
                 "--micro-batch-size", "2", "--max-batches", "1", "--no-ltr", "--objective", "fast_dllm_v2",
                 "--allow-objective-change", "--json", str(out)]) == 0  # fmt: skip
    capsys.readouterr()
    report = json.loads(out.read_text())
    assert (report["objective"], report["block_size"]) == ("fast_dllm_v2", 4)


@pytest.mark.parametrize("data", ["artifacts/x", "[1, 2]", "3"])
def test_a_run_config_whose_data_is_no_mapping_reads_as_no_data_record(tmp_path: Path, data: str) -> None:
    """``loaded.get("data") or {}`` then ``.get`` raised AttributeError (a traceback) on such a config.yaml."""
    from csbp.config.schema import DOCUMENT_MASK_DEFAULTS
    from csbp.evaluation.settings import run_config_settings

    (tmp_path / "run" / "final").mkdir(parents=True)
    (tmp_path / "run" / "config.yaml").write_text(f"objective: {{name: bd3, block_size: 4}}\ndata: {data}\n")
    settings = run_config_settings(tmp_path / "run" / "final")
    assert settings["document_mask"] is DOCUMENT_MASK_DEFAULTS["bd3"][0] and settings["reset_positions"] is False


def test_csbp_eval_on_an_ar_run_names_eval_not_generate(tmp_path: Path) -> None:
    """The refusal read "...; csbp generate samples block-diffusion models" in an eval command."""
    from csbp.evaluation.settings import run_config_settings

    (tmp_path / "run" / "final").mkdir(parents=True)
    (tmp_path / "run" / "config.yaml").write_text("objective: {name: ar}\n", encoding="utf-8")
    with pytest.raises(ValueError) as info:
        run_config_settings(tmp_path / "run" / "final")
    assert "trained objective 'ar', not a block-diffusion model" in str(info.value)
    assert "which csbp eval scores" in str(info.value) and "generate" not in str(info.value)
    assert "(fix: --model the export of a block-diffusion run; an ar run's val_loss" in str(info.value)


def test_csbp_eval_refuses_a_negative_seed_by_its_flag(capsys: pytest.CaptureFixture[str]) -> None:
    """`--seed -1` said "--seed must be >= 0, got -1", with no fix, after the parsing."""
    assert main(["eval", "--model", "m", "--data", "d", "--seed", "-1"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "argument --seed: -1 must be >= 0" in line


def _error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_csbp_eval_fails_closed(trained: tuple[Path, Path, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir, artifact, _ = trained
    model = str(run_dir / "final")
    assert "is not a directory" in _error(capsys, ["eval", "--model", str(tmp_path / "none"), "--data", str(artifact)])
    assert "not a csbp data artifact" in _error(capsys, ["eval", "--model", model, "--data", str(tmp_path)])
    assert "not a multiple of max(--cp, --bp) = 2" in _error(
        capsys, ["eval", "--model", model, "--data", str(artifact), "--nproc", "3", "--cp", "2"]
    )
    assert "does not divide the sequence length 32" in _error(
        capsys, ["eval", "--model", model, "--data", str(artifact), "--block-size", "5", "--allow-block-size-change"]
    )
    bare = tmp_path / "bare"  # a checkpoint without a run config next to it
    small = Decoder(tiny_model_config(), dtype=torch.float32, seed=0)
    export_hf_checkpoint(small, tiny_model_config(), bare)
    assert "pass --objective" in _error(capsys, ["eval", "--model", str(bare), "--data", str(artifact)])
    message = _error(capsys, ["eval", "--model", str(bare), "--data", str(artifact), "--objective", "bd3", "--block-size", "4"])
    assert "embeds 64" in message and "fix:" in message
    other = make_artifact(tmp_path / "other", seed=5, num_docs=30)  # another trained tokenizer
    assert "but the tokenizer of the data" in _error(capsys, ["eval", "--model", model, "--data", str(other)])


def test_csbp_eval_refuses_a_silent_objective_or_block_size_change(
    trained: tuple[Path, Path, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir, artifact, _ = trained
    out = tmp_path / "eval.json"
    config_file = run_dir / "config.yaml"
    args = ["eval", "--model", str(run_dir / "final"), "--data", str(artifact), "--samples", "1", "--no-ltr",
            "--max-batches", "1", "--micro-batch-size", "2"]
    assert _error(capsys, [*args, "--block-size", "8"]) == (
        f"csbp: error: --block-size 8: the model was trained with block size 4 ({config_file}) "
        "(fix: drop --block-size, or add --allow-block-size-change to evaluate with another block size)"
    )
    assert _error(capsys, [*args, "--objective", "mdlm"]) == (
        f"csbp: error: --objective mdlm: the model was trained with objective bd3 ({config_file}) "
        "(fix: drop --objective, or add --allow-objective-change to evaluate with another objective)"
    )
    assert main([*args, "--objective", "bd3", "--block-size", "4"]) == 0  # the trained values are fine
    assert "csbp eval:" not in capsys.readouterr().err  # (stderr has the progress bar)
    for flags, objective, block_size, note in (
        (["--block-size", "8", "--allow-block-size-change"], "bd3", 8, "block size 8, not the trained 4"),
        (["--objective", "mdlm", "--allow-objective-change"], "mdlm", 32, "objective mdlm, not the trained bd3"),
    ):
        assert main([*args, *flags, "--json", str(out)]) == 0
        notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("csbp eval:")]
        assert notes == [f"csbp eval: evaluating with {note} ({config_file}; {flags[-1]})"]
        report = json.loads(out.read_text())
        assert (report["objective"], report["block_size"]) == (objective, block_size)


def test_csbp_eval_checks_its_settings_before_loading_the_weights(
    trained: tuple[Path, Path, str], tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The block size against the data and the vocabulary against the model were checked after the
    # weights loaded, and --nproc > 1 loaded a copy in the launching process only to delete it.
    import csbp.evaluation.parallel as parallel
    import csbp.models.hf_io as hf_io

    def no_loading(*args: object, **kwargs: object) -> None:
        raise AssertionError("the weights were loaded")

    def no_launch(*args: object, **kwargs: object) -> None:
        raise ValueError("the ranks would start here")

    monkeypatch.setattr(hf_io, "load_hf_checkpoint", no_loading)
    monkeypatch.setattr(parallel, "evaluate_parallel", no_launch)
    run_dir, artifact, _ = trained
    model = str(run_dir / "final")
    assert "does not divide the sequence length 32" in _error(
        capsys, ["eval", "--model", model, "--data", str(artifact), "--block-size", "5", "--allow-block-size-change"]
    )
    bare = tmp_path / "bare"
    export_hf_checkpoint(Decoder(tiny_model_config(), dtype=torch.float32, seed=0), tiny_model_config(), bare)
    message = _error(capsys, ["eval", "--model", str(bare), "--data", str(artifact), "--objective", "bd3", "--block-size", "4"])
    assert "embeds 64" in message
    assert "the ranks would start here" in _error(capsys, ["eval", "--model", model, "--data", str(artifact), "--nproc", "2"])


def test_csbp_eval_masks_documents_as_the_objective_trains_by_default(
    trained: tuple[Path, Path, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A checkpoint without a run record was scored with document_mask=False whatever --objective said,
    while fast_dllm_v2 trains with the document mask by default; now the objective's training default,
    --[no-]document-mask to set it, and a flag contradicting a run's record is refused."""
    from dataclasses import replace

    from csbp.data.artifact import open_artifact
    from csbp.evaluation import resolve_settings

    run_dir, artifact, _ = trained
    opened = open_artifact(artifact)
    config = replace(tiny_model_config(), vocab_size=opened.vocab_size)
    bare = tmp_path / "bare"
    export_hf_checkpoint(Decoder(config, dtype=torch.float32, seed=0), config, bare)

    def masked(objective: str, flag: bool | None = None) -> bool:
        given = {} if flag is None else {"document_mask": flag}
        size = None if objective == "mdlm" else 4
        return resolve_settings(bare, config, opened, objective=objective, block_size=size, **given).document_mask

    assert (masked("fast_dllm_v2"), masked("bd3"), masked("mdlm")) == (True, False, False)
    assert (masked("fast_dllm_v2", False), masked("bd3", True)) == (False, True)
    args = ["eval", "--model", str(run_dir / "final"), "--data", str(artifact)]
    assert _error(capsys, [*args, "--document-mask"]) == (
        f"csbp: error: --document-mask: the model was trained with data.document_mask false ({run_dir / 'config.yaml'}), "
        "which csbp eval evaluates with (fix: drop the flag; it is for checkpoints that record no training settings)"
    )


def test_the_nelbo_counts_the_targetable_tokens_and_draws_its_own_noise() -> None:
    """Fast-dLLM v2's NELBO divides by the tokens a left-to-right model could be scored on: every
    supervised token but a row's first and each document's first (predicted from nothing of their own). A
    denominator of the supervised tokens instead (position 0 and document starts counted) passed every test,
    the statistical one being too noisy to see a NELBO ~6% low. The diffusion NELBOs draw their levels on the
    rotated lattice, whatever the training's scheme."""
    batch = _batch()  # 2 x 16 tokens, one unsupervised
    nelbo = nelbo_objective(build_objective("fast_dllm_v2", mask_token_id=MASK_TOKEN_ID, block_size=4))
    corrupted = nelbo.corrupt(batch, corruption_generator(0, 0, 0))
    assert corrupted.loss_normaliser == 2 * SEQ_LEN - 2 - 1  # row starts and the unsupervised token
    documents = {**batch, "doc_ids": torch.tensor([[0] * 6 + [1] * 10, [0] * 16])}
    corrupted = nelbo.corrupt(documents, corruption_generator(0, 0, 0))
    assert corrupted.loss_normaliser == 2 * SEQ_LEN - 3 - 1  # and the second document's first token
    for name, options in (("bd3", {"block_size": 4}), ("mdlm", {})):
        trained = build_objective(name, mask_token_id=MASK_TOKEN_ID, noise_scheme="stratified", **options)
        assert nelbo_objective(trained).noise_scheme == "rotated_lattice", name


def test_the_report_s_stderr_is_that_of_the_mean_of_its_draws() -> None:
    """The NELBO is the mean of K draws' estimates; its standard error is their sample deviation over
    sqrt(K). The deviation itself (sqrt(K) times too wide) passed every test."""
    from types import SimpleNamespace

    from csbp.evaluation.runner import EvalOptions, EvalSums, build_report

    sums = EvalSums(nelbo=[10.0, 12.0, 11.0, 15.0], nelbo_tokens=[5.0] * 4, ltr=9.0, ltr_tokens=5.0, rows=2)
    split = SimpleNamespace(name="val", num_rows=2)
    settings = EvalSettings("bd3", 4, MASK_TOKEN_ID)
    report = build_report(sums, sums, split, settings, EvalOptions(samples=4), 1.0)  # type: ignore[arg-type]
    estimates = torch.tensor([2.0, 2.4, 2.2, 3.0], dtype=torch.float64)
    assert report.nelbo == pytest.approx(float(estimates.mean()))
    assert report.nelbo_stderr == pytest.approx(float(estimates.std()) / 2)
    assert report.ltr_nll == pytest.approx(9.0 / 5.0) and report.nelbo_tokens == 5


def test_the_validation_nelbo_counts_supervised_tokens_whatever_the_loss_counts(tmp_path: Path) -> None:
    """``val_nelbo`` divides by the supervised tokens, as ``csbp eval`` does, also when the run's loss
    divides by every token (``objective.denominator: all_tokens``) and rows are padded. Dividing it by the
    loss's denominator passed every test."""
    artifact = make_artifact(tmp_path / "art")  # its 10 validation rows hold 24 padding tokens

    def metrics(denominator: str) -> dict[str, float]:
        cfg = tiny_config(artifact, **{**CLIPPED, "objective.denominator": denominator})
        inputs = check_run(cfg)
        runner = StepRunner(
            Decoder(inputs.decoder_config, dtype=torch.float64, seed=0), inputs.build_objective(),
            rank_plan_for(cfg, single_process_context()), single_process_context(),
            device=torch.device("cpu"), precision="fp64", seed=0, ce_chunk_rows=64,
        )
        assert inputs.val_split is not None and inputs.val_split.num_rows == 10
        result = runner.evaluate(inputs.val_split, micro_batch_size=2, num_batches=5)  # every row once
        return {"loss": result.loss, **result.metrics}

    supervised, every = metrics("supervised_tokens"), metrics("all_tokens")
    assert every["nelbo"] == pytest.approx(supervised["nelbo"], rel=1e-12)
    assert every["loss"] < supervised["loss"] * (1 - 1e-3)  # the loss itself is divided by more tokens


@pytest.mark.parametrize(
    ("cp", "bp", "fix"),
    [(3, 1, "--cp 2 or 4, or --cp 1 --bp 1"), (1, 32, "--bp 16, or --cp 1 --bp 1"), (3, 6, "--cp 2, or --cp 1 --bp 1")],
)
def test_csbp_eval_names_the_cp_and_bp_that_split_the_data_s_rows(cp: int, bp: int, fix: str) -> None:
    """``--cp 3`` on rows of 64 tokens said "(fix: seq_len=60 or 72)", a config field csbp eval has no flag for."""
    from csbp.evaluation import EvalSettings
    from csbp.evaluation.parallel import eval_topology

    settings = EvalSettings(objective="bd3", block_size=4, mask_token_id=0)
    with pytest.raises(ValueError) as info:
        eval_topology(max(cp, bp), cp, bp, settings, 64)
    message = str(info.value)
    assert message.startswith(f"--cp {cp} --bp {bp}: ") and f"(fix: {fix}" in message, message
    assert "seq_len=" not in message.split("(fix:")[1] and "block_size=" not in message.split("(fix:")[1]


def test_csbp_eval_refuses_a_token_id_past_the_embedding_before_any_forward(
    trained: tuple[Path, Path, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A token file changed after csbp data prepare (same size, so it opens) holding an id the model
    does not embed: the manifest's max_token_id (no fingerprint covers it) passed the vocabulary
    check, and the forward raised IndexError (a device-side assert on CUDA)."""

    import numpy as np

    run_dir, artifact, _ = trained
    changed = shutil.copytree(artifact, tmp_path / "art")
    tokens = np.memmap(changed / "val.tokens.bin", dtype="<u4", mode="r+")
    tokens[32 + 5] = 300  # row 1, position 5; the tokenizer (and the model) has ids [0, 300)
    tokens.flush()
    del tokens
    argv = ["eval", "--model", str(run_dir / "final"), "--data", str(changed), "--split", "val", "--samples", "1",
            "--no-ltr", "--device", "cpu"]
    assert _error(capsys, argv) == (
        "csbp: error: --split val: row 1 holds token id 300 at position 5, outside the model vocabulary [0, 300) "
        "(fix: evaluate data prepared with the model's tokenizer; if it was, its token files changed since: "
        "check with csbp data inspect --verify)"
    )
