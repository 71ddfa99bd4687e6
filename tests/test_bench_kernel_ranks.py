"""``csbp bench kernels --layouts``: one rank's attention per layout on one device (``csbp.bench.kernel_ranks``).

The stand-in ring must give the transport what a real ring would if every member held this rank's
shard: checked in float64 against the dense reference over exactly those keys. The busiest rank, the
dense baseline's shapes, the fail-closed options and the rows in the table, ``--json`` and the target
line are checked on the CPU (tiles).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from csbp.attention.layouts import rank_layout
from csbp.attention.rows import Rows, allow_matrix
from csbp.attention.transports.exchange import cp_exchange_spec, csbp_exchange_spec, remote_keys
from csbp.attention.transports.factory import build_attention
from csbp.bench.kernel_ranks import (
    LocalRing,
    busiest_rank,
    check_layouts,
    key_rows,
    parse_topologies,
    topology_name,
)
from csbp.bench.kernel_summary import summarize_rank_rows, target_line
from csbp.bench.measure import allowed_pairs
from csbp.cli.main import main
from csbp.topology import Topology
from test_kernel import TOL64, dense_attention_reference

L, B = 64, 4


def test_local_ring_gathers_this_shard_once_per_member_and_sums_the_scatter() -> None:
    ring = LocalRing(3, 1)
    shard = torch.arange(2 * 5, dtype=torch.float64).reshape(2, 5)
    gathered, pending = ring.all_gather(shard, async_op=True)
    assert torch.equal(pending.wait(), torch.cat([shard] * 3)) and gathered is pending.wait()
    full = torch.arange(6 * 5, dtype=torch.float64).reshape(6, 5)
    _, pending = ring.reduce_scatter(full, async_op=True)
    assert torch.equal(pending.wait(), full[0:2] + full[2:4] + full[4:6])


@pytest.mark.parametrize("transport", ["collective", "streaming"])
@pytest.mark.parametrize("text", ["cp2", "cp4", "cp2/bp4"])
def test_a_rank_through_the_local_ring_attends_its_own_shard_in_every_members_place(text: str, transport: str) -> None:
    """What the transport computes with ``LocalRing`` is attention over the rank's own rows plus every
    other member's exchanged rows carrying this rank's shard values (row for row): float64, against the
    dense reference over those keys, forward and every input gradient (the streaming ring's gradient
    accumulator comes back summed over its hops, as the collective's reduce-scatter sums)."""
    (topology,) = parse_topologies([text])
    rank = 1
    layout = rank_layout(topology, rank, L, B)
    make_spec = cp_exchange_spec if topology.layout == "cp" else csbp_exchange_spec
    spec = make_spec(layout, seq_len=L, block_size=B, cp=topology.cp, cp_rank=rank % topology.cp)
    remote = remote_keys(spec)
    ring = LocalRing(topology.cp, rank % topology.cp)
    attention = build_attention(topology, rank, layout, ring, block_size=B, transport=transport)  # type: ignore[arg-type]
    n = len(layout.rows)
    gen = torch.Generator().manual_seed(3)
    q, k, v, dout = (torch.randn(1, h, n, 8, dtype=torch.float64, generator=gen) for h in (4, 2, 2, 4))
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    attention(*leaves).backward(dout)

    ref = [t.clone().requires_grad_(True) for t in (q, k, v)]
    shard_rows = spec.exchange_start + remote.row  # each remote key's value: this rank's shard row
    keys = torch.cat([ref[1], ref[1][:, :, shard_rows]], dim=2)
    values = torch.cat([ref[2], ref[2][:, :, shard_rows]], dim=2)
    allow = allow_matrix(layout.rows, Rows.cat([layout.rows, remote.rows]))
    out, _ = dense_attention_reference(ref[0], keys, values, allow, 8**-0.5)
    out.backward(dout)
    for got, want in zip([attention(*leaves).detach(), *(leaf.grad for leaf in leaves)],
                         [out.detach(), *(r.grad for r in ref)]):
        torch.testing.assert_close(got, want, **TOL64)


def test_the_busiest_rank_has_the_most_allowed_pairs_and_its_dense_baseline_reads_every_key_row() -> None:
    for text, keys_of in (("cp2", lambda layout: 2 * L), ("bp4", lambda layout: len(layout.rows)),
                          ("cp2/bp4", lambda layout: layout.num_noisy + L)):
        (topology,) = parse_topologies([text])
        rank, layout, pairs = busiest_rank(topology, L, B)
        counts = [allowed_pairs(rank_layout(topology, r, L, B).rows, block_size=B) for r in range(topology.local)]
        assert pairs == max(counts) == counts[rank] and rank == counts.index(max(counts))
        assert key_rows(topology, layout, L) == keys_of(layout)
        assert topology_name(topology) == text


@pytest.mark.parametrize(("texts", "message"), [
    (["dp2/cp2"], "name one sample's ranks"),
    (["cp1"], "name one sample's ranks"),
    (["cp4/bp6"], r"--layouts 'cp4/bp6': bp6 is not a multiple of cp4, which a fused CSBP layout needs \(fix: e.g. cp4/bp8\)"),
    (["cp2", "tp2"], "--layouts 'tp2' is not of the form"),
])
def test_layouts_fail_closed_on_a_topology_that_is_not_one_samples_layout(texts: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_topologies(texts)


def test_layouts_name_the_topology_and_length_a_sequence_does_not_fit() -> None:
    with pytest.raises(ValueError, match=r"--layouts cp4/bp4 at L=48 B=4: .*"):
        check_layouts([Topology(cp=4, bp=4)], [48], [4])
    check_layouts([Topology(cp=2, bp=4)], [64], [4])  # fits: no error


def test_layouts_rows_in_the_table_json_and_target_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "k.json"
    code = main(["bench", "kernels", "--seq-lens", "64", "--block-sizes", "4", "--repeats", "1", "--warmup", "0",
                 "--num-heads", "2", "--num-kv-heads", "1", "--head-dim", "8", "--clean-kernels", "generic",
                 "--no-op-count", "--layouts", "cp2", "bp2", "cp2/bp4", "--layout-clean", "generic", "pieces",
                 "--layout-transports", "collective", "streaming", "--json", str(out)])
    assert code == 0
    records = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 0  # the forms' panel and the ranks' bars
    ranks = [r for r in records if r["form"] == "rank"]
    assert [(r["topology"], r["clean"], r["transport"]) for r in ranks] == [  # every layout per variant first
        (t, c, "-" if t == "bp2" else s) for c in ("generic", "pieces") for s in ("collective", "streaming")
        for t in ("cp2", "bp2", "cp2/bp4") if not (t == "bp2" and s == "streaming")  # BP-only has no ring
    ]
    for r in ranks:
        topology = parse_topologies([r["topology"]])[0]
        layout = rank_layout(topology, r["rank"], 64, 4)
        assert r["useful_pairs"] == allowed_pairs(layout.rows, block_size=4)
        assert r["dense_shape"] == [len(layout.rows), key_rows(topology, layout, 64)]
        assert r["time_s"] > 0 and r["tflops"] > 0 and r["vs_dense"] > 0
        assert r["diagonal"] == "matmul"  # auto on tiles below B = 16, as training resolves it
    printed = capsys.readouterr().out
    assert "cp2/bp4 r0" in printed and "cp2/bp4 r0 streaming" in printed and "the busiest rank of each layout" in printed
    big = [{**r, "seq_len": 16384} for r in records]  # the target line counts them inside its range
    best = {t: max(r["vs_dense"] for r in ranks if r["topology"] == t) for t in ("cp2", "bp2", "cp2/bp4")}
    worst = min(best, key=best.__getitem__)  # each layout's fastest kernel and transport, then the worst layout
    assert f"busiest ranks worst {best[worst]:.2f}x ({worst}) dense's rate (>= 0.60x)" in target_line(big)
    assert "layout rate" in target_line(big)  # far below 0.6 on a CPU at these sizes: named as missed
    assert "busiest ranks" not in target_line([r for r in big if r["form"] != "rank"])
    summary = summarize_rank_rows(records)
    assert summary in printed  # the command's last lines
    assert summary.startswith(f"{len(records)} rows; busiest rank's rate against dense over its shapes: cp2 r")
    verdict = "met" if best[worst] >= 0.5 else "missed"
    assert summary.endswith(f"worst {best[worst]:.2f}x (>= 0.50x on the CPU): {verdict}")
    assert summary.count(" at L=64 B=4") == 3
    on_cuda = [{**r, "device": "cuda:0", "vs_dense": 0.55} for r in ranks]
    assert summarize_rank_rows(on_cuda).endswith("worst 0.55x (>= 0.60x on CUDA): missed")
    assert summarize_rank_rows([{**r, "vs_dense": 0.7} for r in on_cuda]).endswith("worst 0.70x (>= 0.60x on CUDA): met")
    assert summarize_rank_rows([]) == "0 rows, none timed"


def test_layouts_fail_before_anything_is_measured(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "kernels", "--seq-lens", "48", "--block-sizes", "4", "--layouts", "cp4/bp4"]) != 0
    printed = capsys.readouterr()
    assert printed.out == "" and "--layouts cp4/bp4 at L=48 B=4: seq_len=48 must be a multiple" in printed.err
    assert main(["bench", "kernels", "--seq-lens", "64", "--block-sizes", "4", "--layouts", "cp2",
                 "--layout-clean", "pieces-cudnn"]) != 0
    printed = capsys.readouterr()
    assert printed.out == "" and "--layout-clean pieces-cudnn needs --device cuda" in printed.err


def test_no_forms_measures_only_the_layouts_rows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "k.json"
    assert main(["bench", "kernels", "--seq-lens", "64", "--block-sizes", "16", "--repeats", "1", "--warmup", "0",
                 "--num-heads", "2", "--num-kv-heads", "1", "--head-dim", "8", "--no-forms", "--layouts", "cp2/bp2",
                 "--json", str(out)]) == 0
    assert [(r["form"], r["topology"], r["diagonal"]) for r in json.loads(out.read_text())] == [("rank", "cp2/bp2", "sdpa")]
    assert out.with_suffix(".png").stat().st_size > 0  # the ranks' bars alone
    assert main(["bench", "kernels", "--no-forms"]) != 0
    assert "--no-forms measures only the --layouts rows" in capsys.readouterr().err
