"""A training step's model FLOPs (``csbp.training.model_flops``) and the ``tflops_per_device`` / ``mfu``
metrics built on them. The attention pairs are checked against the mask predicates themselves (the dense
mask's count of allowed pairs), the whole count against the device check's BD3 formula, and a run's
logged rate against the FLOPs of the batches it trained."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch

from csbp.attention.counts import position_pairs
from csbp.attention.documents import Documents, packed_doc_ids, random_documents
from csbp.gpu.flops import bd3_step_flops
from csbp.masks.builders import dense_mask
from csbp.masks.predicates import ar_mask, bd3_mask, mdlm_mask
from csbp.models.config import DecoderConfig
from csbp.objectives import build_objective
from csbp.objectives.base import corruption_generator
from csbp.training import launch_training
from csbp.training.metrics import mfu_peak_tflops, step_line
from csbp.training.model_flops import corrupted_flops, row_pairs
from csbp.training.preflight import check_run
from test_training_run import make_artifact, metric_rows, tiny_config

CONFIG = DecoderConfig(vocab_size=97, hidden_size=24, intermediate_size=40, num_layers=3, num_heads=4,
                       num_kv_heads=2, head_dim=6)
DOC_IDS = torch.tensor([0] * 5 + [1] * 9 + [2] * 2 + [3] * 8)  # 24 tokens, documents cutting blocks of 4


@pytest.mark.parametrize("window", [None, 3, 9])
@pytest.mark.parametrize("documents", [False, True])
def test_two_stream_pairs_are_the_bd3_predicates_allowed_pairs(window: int | None, documents: bool) -> None:
    doc_ids = DOC_IDS if documents else None
    dense = dense_mask(bd3_mask(24, 4, window=window, doc_ids=doc_ids), 48, 48)
    spans = Documents.from_doc_ids(DOC_IDS) if documents else None
    got = row_pairs(24, block_size=4, two_stream=True, causal=False, window=window, documents=spans)
    assert got == int(dense.sum())


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("documents", [False, True])
def test_single_stream_pairs_are_the_mdlm_and_ar_predicates_allowed_pairs(causal: bool, documents: bool) -> None:
    doc_ids = DOC_IDS if documents else None
    mask = ar_mask(24, doc_ids=doc_ids) if causal else mdlm_mask(24, doc_ids=doc_ids)
    spans = Documents.from_doc_ids(DOC_IDS) if documents else None
    got = row_pairs(24, block_size=24, two_stream=False, causal=causal, window=None, documents=spans)
    assert got == int(dense_mask(mask, 24, 24).sum())


def _corrupted(name: str, rows: int = 2, **options: object):  # noqa: ANN202 - a CorruptedBatch
    if name != "ar":  # the one objective without a mask token
        options["mask_token_id"] = CONFIG.vocab_size - 1
    objective = build_objective(name, **options)
    ids = torch.randint(0, CONFIG.vocab_size - 1, (rows, 24), generator=torch.Generator().manual_seed(0))
    return objective.corrupt({"input_ids": ids, "doc_ids": DOC_IDS.expand(rows, 24)}, corruption_generator(0, 1, 0))


def test_a_bd3_batch_counts_what_the_device_check_counts_per_row() -> None:
    batch = _corrupted("bd3", block_size=4)
    assert corrupted_flops(batch, CONFIG, causal=False, window=None, document_mask=False) == bd3_step_flops(
        CONFIG, seq_len=24, block_size=4, samples=2
    )


def test_fast_dllm_v2_counts_both_complementary_views_and_documents_lower_the_count() -> None:
    batch = _corrupted("fast_dllm_v2", block_size=4)
    assert batch.noisy_ids.shape[0] == 4  # two views of each of the two rows
    plain = corrupted_flops(batch, CONFIG, causal=False, window=None, document_mask=False)
    assert plain == bd3_step_flops(CONFIG, seq_len=24, block_size=4, samples=4)
    masked = corrupted_flops(batch, CONFIG, causal=False, window=None, document_mask=True)
    pairs = int(dense_mask(bd3_mask(24, 4, doc_ids=DOC_IDS), 48, 48).sum())
    full = int(dense_mask(bd3_mask(24, 4), 48, 48).sum())
    assert plain - masked == 4 * 12 * CONFIG.head_dim * CONFIG.num_heads * CONFIG.num_layers * (full - pairs)


def test_single_stream_rows_process_l_rows() -> None:
    batch = _corrupted("ar")
    dense = 6 * 24 * CONFIG.num_layers * (24 * (2 * 24 + 2 * 12) + 3 * 24 * 40)  # q, k, v, o; gate, up, down
    head = 6 * 24 * CONFIG.vocab_size * CONFIG.hidden_size
    attention = 12 * CONFIG.head_dim * CONFIG.num_heads * CONFIG.num_layers * (24 * 25 // 2)
    assert corrupted_flops(batch, CONFIG, causal=True, window=None, document_mask=False) == 2 * (
        dense + head + attention
    )


def test_mfu_is_against_a_known_gpus_bf16_peak_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert mfu_peak_tflops(torch.device("cuda", 0), "bf16") == 989.0
    assert mfu_peak_tflops(torch.device("cuda", 0), "fp32") is None  # another peak
    assert mfu_peak_tflops(torch.device("cpu"), "bf16") is None
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A10G")
    assert mfu_peak_tflops(torch.device("cuda", 0), "bf16") is None
    line = step_line({"step": 3, "loss": 1.0, "lr": 1e-3, "grad_norm": 0.5, "mfu": 0.1234})
    assert line.endswith("grad_norm 0.500 mfu 12.3%")


def test_a_runs_logged_rate_is_its_batches_flops_over_the_step_time(tmp_path: Path) -> None:
    artifact = make_artifact(tmp_path / "art")
    cfg = tiny_config(artifact, **{"train.eval_every": 0})
    launch_training(cfg, run_dir=tmp_path / "run", max_steps=2)
    rows = [r for r in metric_rows(tmp_path / "run") if r.get("loss") is not None]
    assert rows and all("mfu" not in r for r in rows)  # the CPU has no peak
    config = check_run(cfg, check_device=False).decoder_config  # the vocabulary is the artifact's
    samples = cfg.topology.dp * cfg.train.micro_batch_size * cfg.train.grad_accum
    expected = bd3_step_flops(config, seq_len=cfg.data.seq_len, block_size=cfg.objective.block_size, samples=samples)
    tokens = samples * cfg.data.seq_len
    for row in rows:  # flops = rate x seconds x devices, with seconds = tokens / tokens_per_s
        flops = row["tflops_per_device"] * 1e12 * cfg.world_size * tokens / row["tokens_per_s"]
        assert flops == pytest.approx(expected, rel=1e-9)


def test_the_summary_reports_median_rates_leaving_out_the_first_step(tmp_path: Path) -> None:
    from csbp.training.summary import TrainSummary

    def summary(speeds: list[dict[str, float]]) -> TrainSummary:
        return TrainSummary(tmp_path, 0, len(speeds), 10, 1.0, [1.0] * len(speeds), [], None, None, speeds=speeds)

    first = {"tokens_per_s": 10.0, "tflops_per_device": 0.5, "mfu": 0.01}  # compiling: slow
    steps = [{"tokens_per_s": v, "tflops_per_device": v / 10, "mfu": v / 1000} for v in (100.0, 300.0, 200.0)]
    line = summary([first, *steps]).speed_line()
    assert line == "speed       200 tokens/s, 20.0 TFLOP/s per device, MFU 20.0% (medians over 3 steps, the first one left out)"
    assert line in summary([first, *steps]).format().splitlines()
    assert summary([{"tokens_per_s": 1234.5}]).speed_line() == "speed       1,234 tokens/s (one step)"
    cpu = summary([{"tokens_per_s": 5466.0, "tflops_per_device": 0.012345}]).speed_line()  # the demo's scale
    assert cpu == "speed       5,466 tokens/s, 0.0123 TFLOP/s per device (one step)"
    assert summary([]).speed_line() is None and "speed" not in summary([]).format()


def _packed_ids(seq_len: int, seed: int) -> torch.Tensor:
    """Random document lengths (1 token up to a few blocks) and a padding tail of ``-1``, as the loader packs."""
    generator = torch.Generator().manual_seed(seed)
    ids, doc = [], 0
    while len(ids) < seq_len:
        ids += [doc] * int(torch.randint(1, 3 * 8, (1,), generator=generator))
        doc += 1
    ids = torch.tensor(ids[:seq_len])
    ids[seq_len - int(torch.randint(0, seq_len // 4, (1,), generator=generator)):] = -1
    return ids


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("window", [None, 1, 5, 17, 1000])
@pytest.mark.parametrize("block_size", [1, 4, 8])
def test_the_per_segment_sum_is_the_per_position_bounds_count(seed: int, window: int | None, block_size: int) -> None:
    """The count per document and block segment equals the planner's per-position bounds
    (``position_pairs``, which the mask tests check against the predicates) on rows of many documents, some
    shorter than a block and a padding tail, and the single-stream counts their per-position sums."""
    seq_len = 96
    spans = Documents.from_doc_ids(_packed_ids(seq_len, seed))
    positions = np.arange(seq_len, dtype=np.int64)
    noisy, clean = position_pairs(positions, positions, block_size=block_size, window=window,
                                  documents=(spans.start.numpy(), spans.stop.numpy()))
    got = row_pairs(seq_len, block_size=block_size, two_stream=True, causal=False, window=window, documents=spans)
    assert got == noisy + clean
    if window is None and block_size == 4:
        start, stop = spans.start.numpy(), spans.stop.numpy()
        for causal, expected in ((True, (positions + 1 - start).sum()), (False, (stop - start).sum())):
            assert row_pairs(seq_len, block_size=seq_len, two_stream=False, causal=causal, window=None,
                             documents=spans) == expected


def test_counting_a_million_token_row_of_documents_holds_no_per_position_arrays() -> None:
    """The count runs on the host before every micro-batch on every rank: at 1M tokens of packed documents the
    per-position bounds (int64 arrays of L entries: 80 MiB in NumPy) took 100-250 ms a row, what a step of a
    few seconds cannot spare; per segment it holds a few MiB and takes milliseconds."""
    seq_len = 1 << 20
    generator = torch.Generator().manual_seed(0)
    doc_ids = packed_doc_ids(random_documents(seq_len, 2048, generator))
    doc_ids[-1000:] = -1
    batch = build_objective("fast_dllm_v2", mask_token_id=CONFIG.vocab_size - 1, block_size=16).corrupt(
        {"input_ids": torch.zeros(1, seq_len, dtype=torch.long), "doc_ids": doc_ids[None]}, corruption_generator(0, 1, 0)
    )
    for window in (None, 4096):
        tracemalloc.start()
        try:
            corrupted_flops(batch, CONFIG, causal=False, window=window, document_mask=True)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 8 * seq_len, f"{peak / 2**20:.1f} MiB"  # less than one int64 array of L entries


def test_a_dflash_step_counts_the_drafters_flops_over_every_anchor_of_its_samples() -> None:
    """The drafter's model FLOPs (12d per attention pair, as the device check's rows) over each sample's full
    anchor packet, whatever a rank owns of it; drawn from the same generator as the step's anchors."""
    from functools import partial

    from csbp.bench.dflash_flops import drafter_step_flops
    from csbp.dflash.anchors import segment_starts
    from csbp.dflash.config import DFlashObjectiveConfig
    from csbp.dflash.layouts import full_packet
    from csbp.dflash.rank_plan import build_dflash_rank_plan
    from csbp.dflash.step import DFlashStep, sample_batch_anchors
    from csbp.dflash.verify import DFlashVerifyCase, build_models, make_batch
    from csbp.engine.context import single_process_context

    _, drafter = build_models(DFlashVerifyCase(), dtype=torch.float32)
    objective = DFlashObjectiveConfig(max_anchors=5)
    plan = build_dflash_rank_plan(single_process_context(), objective)
    counter = partial(drafter_step_flops, model_flops=True)
    batch = make_batch(2, 32)  # the second sample packs two documents and ends in padding
    out = DFlashStep(drafter, objective, plan, count_flops=counter)(batch, torch.Generator().manual_seed(3))
    anchors = sample_batch_anchors(batch, objective, drafter.config.block_size, torch.Generator().manual_seed(3))
    expected = sum(
        counter(drafter.config, full_packet(anchors[s], segment_starts(batch.doc_ids[s])[anchors[s]]), 32, 32)
        for s in range(2)
    )
    assert out.model_flops == expected > 0
    assert DFlashStep(drafter, objective, plan)(batch, torch.Generator().manual_seed(3)).model_flops is None
