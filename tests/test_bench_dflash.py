"""``csbp bench dflash``: a smoke run through the command (seq len 64, 2 gloo processes, one warmup
and one measured step, all three layouts), the FLOP accounting and the layout choices.

Beyond "it runs" the smoke run checks what the layouts must satisfy: the same step-0 loss in every
layout (same weights, batch and anchors; float32, 1e-5 relative), no attention traffic in BP-only
(context replicated), and fewer drafter FLOPs per rank in CSBP than in CP-only (CP-only ranks
process every anchor).
Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_bench_dflash.py -q``
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from csbp.bench.common import layout_topologies
from csbp.bench.dflash_bench import (
    DFlashBenchConfig,
    DFlashRecord,
    drafter_step_flops,
    format_table,
    run_dflash_bench,
)
from csbp.bench.dflash_cli import register_dflash_bench
from csbp.dflash.layouts import AnchorPacket, DFlashLayout, full_packet, owned_packet

RECORD_KEYS = {
    "layout",
    "cp",
    "bp",
    "dp",
    "seq_len",
    "anchors",
    "block_size",
    "nproc",
    "samples",
    "step_time_s",
    "drafter_flops_per_rank",
    "attention_bytes_per_rank",
    "peak_mem_bytes",
    "loss_step0",
    # the drafter's shape, for `csbp plan calibrate`
    "bench",
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "vocab_size",
    "feature_width",
    "dtype",
    "doc_length",
    "sliding_window",
    # --ablate-overlap (None without it)
    "serialized_step_time_s",
    "overlap_ratio",
    "target_capture",
    "target_bytes_per_rank",
    "step_times_s",
    "serialized_step_times_s",
    "bytes_step",
}
TINY = ["--block-size", "4", "--vocab-size", "64", "--hidden-size", "32", "--intermediate-size", "64"]
TINY += ["--num-heads", "4", "--num-kv-heads", "2", "--head-dim", "8"]


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="csbp bench")
    register_dflash_bench(parser.add_subparsers(dest="bench_command"))
    return parser.parse_args(argv)


@pytest.mark.multiprocess
def test_smoke_run_writes_records_table_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench" / "dflash.json"
    argv = ["dflash", "--seq-lens", "64", "--anchors", "8", "--nproc", "2", "--repeats", "1", "--warmup", "1"]
    args = parse([*argv, *TINY, "--layouts", "cp", "csbp", "bp", "--json", str(out)])
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    assert "x cp" in printed and f"wrote {out}" in printed

    records = json.loads(out.read_text())
    assert [r["layout"] for r in records] == ["cp", "csbp", "bp"]
    for record in records:
        assert set(record) == RECORD_KEYS
        assert record["serialized_step_time_s"] is None and record["overlap_ratio"] is None
        assert record["step_times_s"] == [record["step_time_s"]] and record["serialized_step_times_s"] == []
        assert record["bytes_step"] == 1  # warmup 1 + repeats 1: the bytes of step 1
        assert (record["seq_len"], record["anchors"], record["nproc"], record["samples"]) == (64, 8, 2, 1)
        assert (
            record["step_time_s"] > 0
            and record["peak_mem_bytes"] >= 0
            and record["drafter_flops_per_rank"] > 0
        )
    by_layout = {r["layout"]: r for r in records}
    assert [(by_layout[n]["cp"], by_layout[n]["bp"], by_layout[n]["dp"]) for n in ("cp", "csbp", "bp")] == [
        (2, 1, 1),
        (2, 2, 1),
        (1, 2, 1),
    ]
    losses = [r["loss_step0"] for r in records]
    assert max(losses) - min(losses) <= 1e-5 * abs(losses[0])
    assert by_layout["bp"]["attention_bytes_per_rank"] == 0
    assert (
        by_layout["cp"]["attention_bytes_per_rank"] > 0 and by_layout["csbp"]["attention_bytes_per_rank"] > 0
    )
    assert by_layout["csbp"]["drafter_flops_per_rank"] < by_layout["cp"]["drafter_flops_per_rank"]
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.multiprocess
def test_online_target_pass_is_timed_in_the_step(tmp_path: Path) -> None:
    """``--target-capture sharded`` runs the frozen target inside each timed step: the same step-0 loss
    as offline features, the ring's K/V all-gather bytes of ``sharded_target_bytes`` (none for BP-only,
    whose ranks run the full row), and records `csbp plan calibrate` refuses (its terms leave it out)."""
    from csbp.dflash.target_shard import sharded_target_bytes
    from csbp.models.config import DecoderConfig
    from csbp.models.decoder import Decoder
    from csbp.plan.fit import bench_observations

    argv = ["dflash", "--seq-lens", "64", "--anchors", "8", "--nproc", "2", "--repeats", "1", "--warmup", "0"]
    losses = {}
    for capture in ("offline", "sharded"):
        out = tmp_path / f"{capture}.json"
        args = parse([*argv, *TINY, "--layouts", "cp", "bp", "--target-capture", capture, "--json", str(out)])
        assert args.func(args) == 0
        records = {r["layout"]: r for r in json.loads(out.read_text())}
        losses[capture] = [r["loss_step0"] for r in records.values()]
        assert all(r["target_capture"] == capture for r in records.values())
    target = Decoder(DecoderConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                                   num_kv_heads=2, head_dim=8), seed=0)
    assert records["cp"]["target_bytes_per_rank"] == sharded_target_bytes(target, 64, 2, num_layers=2, element_size=4)
    assert records["bp"]["target_bytes_per_rank"] == 0
    for offline, online in zip(losses["offline"], losses["sharded"], strict=True):
        assert abs(offline - online) <= 1e-5 * abs(offline)
    with pytest.raises(ValueError, match="target-capture sharded"):
        bench_observations([out])


@pytest.mark.multiprocess
def test_documents_exchange_fewer_context_bytes(tmp_path: Path) -> None:
    """With short packed documents CSBP and cp-aware exchange only the context rows an anchor may see:
    fewer attention bytes than CP-only's all-gather, the same step-0 loss. ``--ablate-overlap`` also
    times each layout with serialized collectives."""
    out = tmp_path / "dflash.json"
    argv = ["dflash", "--seq-lens", "64", "--anchors", "8", "--nproc", "2", "--repeats", "1", "--warmup", "0"]
    argv += ["--ablate-overlap"]
    args = parse([*argv, *TINY, "--layouts", "cp", "cp-aware", "csbp", "--doc-length", "8", "--json", str(out)])
    assert args.func(args) == 0
    records = {r["layout"]: r for r in json.loads(out.read_text())}
    for r in records.values():
        assert r["serialized_step_time_s"] > 0
        assert r["overlap_ratio"] == pytest.approx(r["step_time_s"] / r["serialized_step_time_s"])
    assert all(r["doc_length"] == 8 for r in records.values())
    losses = [r["loss_step0"] for r in records.values()]
    assert max(losses) - min(losses) <= 1e-5 * abs(losses[0])
    cp_bytes = records["cp"]["attention_bytes_per_rank"]
    assert 0 < records["cp-aware"]["attention_bytes_per_rank"] < cp_bytes
    assert 0 < records["csbp"]["attention_bytes_per_rank"] < cp_bytes


@pytest.mark.multiprocess
def test_bytes_are_the_last_timed_steps(tmp_path: Path) -> None:
    """Documents and anchors are drawn per step, so the bytes recorded are one step's, the last
    timed one, named by ``bytes_step``: ``--warmup 1 --repeats 1`` and ``--warmup 0 --repeats 2``
    both end at step 1 and count the same bytes (a table recorded without it could not be rerun)."""
    bytes_of = {}
    for warmup, repeats in ((1, 1), (0, 2)):
        out = tmp_path / f"w{warmup}r{repeats}.json"
        argv = ["dflash", "--seq-lens", "64", "--anchors", "8", "--nproc", "2", "--warmup", str(warmup)]
        argv += ["--repeats", str(repeats), *TINY, "--layouts", "cp-aware", "csbp", "--doc-length", "8"]
        args = parse([*argv, "--json", str(out)])
        assert args.func(args) == 0
        records = json.loads(out.read_text())
        assert [r["bytes_step"] for r in records] == [1, 1]
        bytes_of[warmup, repeats] = [r["attention_bytes_per_rank"] for r in records]
    assert bytes_of[1, 1] == bytes_of[0, 2]


@pytest.mark.multiprocess
def test_sliding_layers_exchange_window_rows_of_one_document(tmp_path: Path) -> None:
    """``--sliding-window`` with one document per row: CSBP exchanges only its anchors' window rows,
    fewer bytes than ``csbp-gather`` (the same CSBP with the all-gather kept), the same step-0 loss."""
    out = tmp_path / "dflash.json"
    argv = ["dflash", "--seq-lens", "64", "--anchors", "8", "--nproc", "2", "--repeats", "1", "--warmup", "0"]
    args = parse([*argv, *TINY, "--layouts", "csbp", "csbp-gather", "--sliding-window", "5", "--json", str(out)])
    assert args.func(args) == 0
    records = {r["layout"]: r for r in json.loads(out.read_text())}
    assert all(r["sliding_window"] == 5 and r["doc_length"] is None for r in records.values())
    assert (records["csbp-gather"]["cp"], records["csbp-gather"]["bp"]) == (2, 2)
    losses = [r["loss_step0"] for r in records.values()]
    assert max(losses) - min(losses) <= 1e-5 * abs(losses[0])
    assert 0 < records["csbp"]["attention_bytes_per_rank"] < records["csbp-gather"]["attention_bytes_per_rank"]


def _config(**options: object) -> DFlashBenchConfig:
    base = {"block_size": 4, "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "head_dim": 8}
    return DFlashBenchConfig(seq_len=64, anchors=8, **{**base, **options})  # type: ignore[arg-type]


def test_flops_of_one_anchor_by_hand() -> None:
    """Hidden 32, 4/2 heads x 8, MLP 64, vocab 64, B = 4, one layer fusing one target layer;
    one anchor at 10 in a 64-token sequence, 6 context rows."""
    config = _config(num_target_layers=2).drafter_config()
    packet = AnchorPacket(torch.tensor([0]), torch.tensor([10]), torch.tensor([0]), torch.tensor([True]))
    block_row = 2 * 32 * (32 + 16 + 16 + 32) + 3 * 2 * 32 * 64  # q, k, v, o + gate, up, down
    context_row = 2 * 32 * (16 + 16)  # the layer's k, v of a context row
    expected = 3 * (4 * block_row + 6 * context_row)  # trainable, input needs grad: fwd + 2 bwd
    expected += 2 * 6 * 2 * 32 * 32  # fc (32 -> 32): forward + weight gradient
    expected += 2 * 3 * 2 * 32 * 64  # frozen head on slots 1..3: forward + input gradient
    expected += 4 * (4 + 10) * 4 * (14 * 8)  # 4 rows x 14 keys, 4 heads, 4d fwd + 10d bwd per pair
    assert drafter_step_flops(config, packet, 6, 64) == expected


def test_sliding_flops_count_the_window_pairs() -> None:
    """W = 3, B = 4, anchor 10: block rows j see ``[10 + j - 2, 10)``: 2, 1, 0, 0 context keys, and
    the causal block 1 + 2 + 3 + 4 keys; the rest as for full attention."""
    full_cfg, sliding_cfg = _config().drafter_config(), _config(sliding_window=3).drafter_config()
    packet = AnchorPacket(torch.tensor([0]), torch.tensor([10]), torch.tensor([0]), torch.tensor([True]))
    per_pair = 4 * (14 * 8)  # 4 heads, 4d forward + 10d backward
    full, sliding = drafter_step_flops(full_cfg, packet, 6, 64), drafter_step_flops(sliding_cfg, packet, 6, 64)
    assert full - sliding == (4 * (4 + 10) - (3 + 10)) * per_pair


def test_flops_of_a_late_anchor_in_a_later_document_and_a_dead_block_by_hand() -> None:
    """The configuration above, L = 64: a live anchor at 62 in a document starting at 40 and a dead
    padding block. Both blocks' rows run the matmuls (the padding is computed); only slot 1 of the live
    anchor is scored (position 63 is the row's last, slots 2, 3 fall outside it); attention counts the
    live anchor's 4 rows x (22 context keys [40, 62) + 4 block keys), none of the dead block's."""
    config = _config(num_target_layers=2).drafter_config()
    packet = AnchorPacket(torch.tensor([0, -1]), torch.tensor([62, 0]), torch.tensor([40, 0]), torch.tensor([True, False]))
    block_row = 2 * 32 * (32 + 16 + 16 + 32) + 3 * 2 * 32 * 64
    context_row = 2 * 32 * (16 + 16)
    expected = 3 * (2 * 4 * block_row + 6 * context_row)  # both blocks' rows, 6 context rows
    expected += 2 * 6 * 2 * 32 * 32  # fc
    expected += 2 * 1 * 2 * 32 * 64  # the head on slot 1 only
    expected += 4 * (4 + 22) * 4 * (14 * 8)  # 4 heads, 4d fwd + 10d bwd per pair
    assert drafter_step_flops(config, packet, 6, 64) == expected
    # MFU's model FLOPs (the device check's DFlash row, as its BD3 rows): 12d per pair, no score recompute
    assert drafter_step_flops(config, packet, 6, 64, model_flops=True) == expected - 4 * (4 + 22) * 4 * (2 * 8)
    sliding = _config(num_target_layers=2, sliding_window=3).drafter_config()
    # W = 3: rows j see [62 + j - 2, 62): 2, 1, 0, 0 context keys, and the causal block 1 + 2 + 3 + 4
    assert expected - drafter_step_flops(sliding, packet, 6, 64) == (4 * (4 + 22) - (3 + 10)) * 4 * (14 * 8)

def test_cp_only_ranks_replicate_the_anchor_work() -> None:
    config = _config().drafter_config()
    anchors, doc_start = torch.tensor([3, 9, 20, 31, 40, 47, 55, 60]), torch.zeros(8, dtype=torch.long)
    full = drafter_step_flops(config, full_packet(anchors, doc_start), 0, 64)
    shares = [
        drafter_step_flops(
            config,
            owned_packet(anchors, doc_start, DFlashLayout(2, r, 2, r, 2.0), context="strict", min_bucket=1),
            0,
            64,
        )
        for r in range(2)
    ]
    assert sum(shares) == full and max(shares) < full  # BP splits the anchors; CP-only ranks do all


def test_layouts_and_validation() -> None:
    topologies = layout_topologies(4, 2, 2)
    assert (topologies["csbp"].dp, topologies["csbp"].cp, topologies["csbp"].bp) == (2, 2, 2)
    assert (topologies["cp"].cp, topologies["bp"].bp) == (4, 4)
    with pytest.raises(ValueError, match="does not divide nproc=4"):
        layout_topologies(4, 3, 3)
    with pytest.raises(ValueError, match="multiple of every layout's dp"):
        run_dflash_bench([64], [8], layouts=["cp", "csbp"], nproc=4, csbp_cp=2, csbp_bp=2, samples=3)
    with pytest.raises(ValueError, match="multiple of 2\\*cp=8"):
        run_dflash_bench([36], [8], layouts=["cp"], nproc=4)
    with pytest.raises(ValueError, match="anchors=2 must be >= bp=4"):
        run_dflash_bench([64], [2], layouts=["csbp"], nproc=4)
    with pytest.raises(ValueError, match="use --doc-length >= 2"):
        _config(doc_length=1)


def test_table_ratios_relative_to_cp() -> None:
    def record(layout: str, step: float, flops: int) -> DFlashRecord:
        return DFlashRecord(layout, 2, 2, 1, 1024, 16, 16, 2, 1, step, flops, 1 << 20, 1 << 20, 3.0)

    rows = [
        line.split()
        for line in format_table([record("cp", 2.0, 4000), record("csbp", 1.0, 1000)]).splitlines()[2:]
    ]
    # after the step time its spread over the repeats ("-": none recorded), then its ratio to cp
    assert rows[1][:3] == ["16", "1024", "csbp"] and rows[1][8] == "0.50" and rows[1][10] == "0.25"


def test_bad_input_prints_only_its_error_line(capsys: pytest.CaptureFixture[str]) -> None:
    from csbp.cli.main import main

    assert main(["bench", "dflash", "--anchors", "1", "--nproc", "4"]) == 2
    out, err = capsys.readouterr()  # the header waits until every input is checked
    assert out == "" and err == "csbp: error: anchors=1 must be >= bp=4 (bp): every BP rank needs one\n"


def test_target_pass_table_and_refusals() -> None:
    from csbp.bench.dflash_target import (
        TargetPassRecord,
        causal_pairs,
        format_target_table,
        run_target_pass_bench,
    )
    from csbp.dflash.layouts import context_positions
    from csbp.models.config import DecoderConfig

    # the zigzag shards split the causal pairs of a row exactly
    assert sum(causal_pairs(context_positions(64, 4, r)) for r in range(4)) == causal_pairs(torch.arange(64))
    records = [
        TargetPassRecord(64, "replicated", 2.0, 100, 1.0, 8.0, 0),
        TargetPassRecord(64, "sharded", 1.0, 40, 0.4, 2.0, 512),
    ]
    lines = format_target_table(records).splitlines()
    assert lines[2].split()[-3:] == ["0.500", "0.400", "0.250"]
    config = DecoderConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=1,
                           num_kv_heads=1, head_dim=8)
    with pytest.raises(ValueError, match="nproc=1 must be >= 2"):
        run_target_pass_bench([64], nproc=1, config=config)
    with pytest.raises(ValueError, match="multiple of 2·nproc=8"):
        run_target_pass_bench([20], nproc=4, config=config)


def test_target_pass_alternates_its_two_passes_step_by_step() -> None:
    """The replicated and sharded target passes alternate every step (the first of a step alternating
    too), instead of all replicated steps and then all sharded ones: a drift of the machine's load
    between the two blocks was read as a speedup of the pass that ran in the quieter one."""
    from csbp.bench.dflash_target import PASSES, pass_order

    assert [pass_order(i) for i in range(4)] == [PASSES, PASSES[::-1], PASSES, PASSES[::-1]]
    assert set(PASSES) == {"replicated", "sharded"}


@pytest.mark.multiprocess
def test_target_pass_command_writes_both_passes(tmp_path: Path) -> None:
    """``csbp bench dflash --target-pass --json``: both passes per length, the sharded one with fewer
    causal pairs per rank (its zigzag rows) and K/V bytes on the ring, the replicated one with none."""
    from csbp.cli.main import main

    out = tmp_path / "target.json"
    argv = ["bench", "dflash", "--target-pass", "--nproc", "2", "--seq-lens", "64", "--repeats", "1",
            "--warmup", "1", "--json", str(out)]
    assert main(argv) == 0
    rows = {r["capture"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"replicated", "sharded"}
    assert rows["replicated"]["bytes_moved"] == 0 < rows["sharded"]["bytes_moved"]
    assert rows["sharded"]["attention_pairs"] < rows["replicated"]["attention_pairs"]
    assert rows["sharded"]["time_s"] > 0 and rows["replicated"]["time_s"] > 0


@pytest.mark.multiprocess
def test_teacher_rows_bench_counts_the_exchange_its_formula_predicts() -> None:
    from csbp.bench.dflash_teacher import _doc_ids, run_teacher_rows_bench
    from csbp.dflash.anchors import sample_anchors, segment_starts
    from csbp.dflash.layouts import DFlashLayout
    from csbp.dflash.teacher_rows import ring_teacher_needs, teacher_exchange_bytes

    seq_len, count, block, cp = 256, 12, 4, 2
    records = run_teacher_rows_bench([seq_len], [count], nproc=cp, block_size=block, doc_length=40)
    mask = torch.ones(seq_len, dtype=torch.bool)
    docs = _doc_ids(seq_len, 40, 0)
    anchors = sample_anchors(mask, docs, max_anchors=count, method="uniform", block_size=block,
                             generator=torch.Generator().manual_seed(0))
    for record in records:
        owners = cp if record.layout == "csbp" else 1
        sent = []
        for rank in range(cp):
            layout = DFlashLayout(cp, rank, owners, rank if owners > 1 else 0, 1.0)
            needs = ring_teacher_needs(torch.zeros(seq_len, dtype=torch.long), mask, docs, anchors,
                                       segment_starts(docs)[anchors], layout, block_size=block, context="strict",
                                       min_bucket=max(1, min(128, count // owners)))
            sent.append(teacher_exchange_bytes(needs, seq_len=seq_len, cp=cp, rank=rank, row_bytes=1))
        assert record.exchange_rows == max(sent) and 0 < record.exchange_rows < record.all_gather_rows == seq_len // 2
