"""Collective (all-gather / reduce-scatter) transport against the single-process reference, plus the
shared multi-process harness of every transport test (csbp.md §18 items 4, 5, 10).

Harness: every worker draws the same random ``q, k, v [S, H, 2L, d]`` and ``dout`` for the
reference rows ``[noisy 0..L-1 ; clean 0..L-1]`` (float64), slices its own packed rows out of them
(``reference index = pos + L * clean``), runs the transport built by ``build_attention`` and
backpropagates its slice of ``dout``. With ``bp > cp`` every ring holds a replica of the clean
stream, so each ring gets a share of the clean rows' ``dout`` (random shares summing to the
reference); by linearity the reference gradient of a clean row is then the SUM over its replicas,
and every noisy row is held exactly once. The parent scatters every rank's results into reference
order and compares with ``LocalAttentionFn`` on ``reference_layout`` (itself checked against a
dense masked softmax) at ``atol = rtol = 1e-10``.

One hand-made case uses clean shards of unequal size (10 and 6 rows) so the wire padding, dead
padding keys and the trimming of returned gradients are exercised. All cases of one world size run
in one launch (cached), shared by the collective, streaming and window test files.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import pytest
import torch

from csbp.attention.layouts import (
    RankLayout,
    bd3_rows,
    cp_zigzag_layout,
    csbp_layout,
    rank_layout,
    reference_layout,
)
from csbp.attention.rows import allow_matrix
from csbp.attention.transports.collective import CollectiveAttention
from csbp.attention.transports.exchange import ExchangeSpec
from csbp.attention.transports.factory import build_attention
from csbp.attention.transports.local import LocalAttentionFn
from csbp.attention.transports.streaming import StreamingAttention
from csbp.parallel.comm import Comm, TrafficCounter
from csbp.parallel.groups import build_process_groups
from csbp.parallel.launch import run_local
from csbp.topology import Topology

NUM_SAMPLES, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 2, 4, 2, 8
TOL = {"atol": 1e-10, "rtol": 1e-10}
BFLOAT16_TOL = {"atol": 1e-2, "rtol": 1e-2}  # bf16 outputs/gradients of float32-accumulated attention


@dataclass(frozen=True)
class TransportCase:
    """One transport run: sequence, topology and transport options (``bp == 1``: CP-only)."""

    seq_len: int
    block_size: int
    cp: int
    bp: int
    transport: str = "collective"
    window: int | None = None
    schedule: str = "dual_end"
    causal_in_block: bool = False
    dtype: str = "float64"
    uneven_clean_shards: bool = False  # hand-made CSBP-like layouts with clean shards of 10 and 6 rows

    @property
    def topology(self) -> Topology:
        return Topology(cp=self.cp, bp=self.bp)

    @property
    def world_size(self) -> int:
        return max(self.cp, self.bp)

    @property
    def num_rings(self) -> int:
        return self.topology.num_rings

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def tolerance(self) -> dict[str, float]:
        return TOL if self.dtype == "float64" else BFLOAT16_TOL

    @property
    def kv_row_bytes(self) -> int:
        """Bytes of one row of K plus V (all samples and KV heads) on the wire: the input dtype."""
        return 2 * NUM_SAMPLES * NUM_KV_HEADS * HEAD_DIM * torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def grad_row_bytes(self) -> int:
        """Bytes of one row of dK plus dV: the accumulation dtype (float64 or float32)."""
        return 2 * NUM_SAMPLES * NUM_KV_HEADS * HEAD_DIM * (8 if self.dtype == "float64" else 4)


def _cases(seq_len: int, block_size: int, cp: int, bp: int, transports: tuple[str, ...], **options) -> list:
    return [TransportCase(seq_len, block_size, cp, bp, transport, **options) for transport in transports]


BOTH = ("collective", "streaming")
FIRST_BLOCK_CASE = TransportCase(16, 4, 2, 4)  # N = 4 blocks on 4 BP ranks: one rank owns block 0 only
CASES_BY_WORLD: dict[int, tuple[TransportCase, ...]] = {
    2: tuple(
        _cases(32, 4, 2, 1, BOTH)  # CP-only
        + _cases(32, 4, 2, 2, BOTH)
        + _cases(32, 4, 2, 2, ("collective",), causal_in_block=True)
        + _cases(32, 4, 2, 2, ("collective",), window=5)
        + _cases(32, 4, 2, 2, BOTH, dtype="bfloat16")
        + _cases(32, 4, 2, 2, ("collective",), window=5, dtype="bfloat16")
        + _cases(16, 2, 2, 2, BOTH, uneven_clean_shards=True)
    ),
    4: tuple(
        _cases(32, 2, 4, 1, BOTH)  # CP-only
        + _cases(32, 2, 2, 4, BOTH)
        + _cases(32, 2, 2, 4, ("collective",), window=3)
        + _cases(32, 2, 2, 4, ("collective",), window=3, schedule="contiguous")
        + [replace(FIRST_BLOCK_CASE, transport=t) for t in BOTH]
        + [replace(FIRST_BLOCK_CASE, window=3)]
        + _cases(32, 2, 4, 4, BOTH)
        + _cases(32, 2, 4, 4, ("collective",), window=3)
    ),
    8: tuple(_cases(32, 2, 4, 8, BOTH) + _cases(32, 2, 4, 8, ("collective",), window=3)),  # two rings of 4
}


def reference_inputs(case: TransportCase) -> dict[str, torch.Tensor]:
    """The same random float64 tensors on every process: reference-row q/k/v/dout and the per-ring
    shares of the clean rows' dout."""
    gen = torch.Generator().manual_seed(1000 * case.seq_len + 10 * case.cp + case.bp)
    num_rows = 2 * case.seq_len

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    inputs = {
        "q": draw(NUM_SAMPLES, NUM_HEADS, num_rows, HEAD_DIM),
        "k": draw(NUM_SAMPLES, NUM_KV_HEADS, num_rows, HEAD_DIM),
        "v": draw(NUM_SAMPLES, NUM_KV_HEADS, num_rows, HEAD_DIM),
        "dout": draw(NUM_SAMPLES, NUM_HEADS, num_rows, HEAD_DIM),
    }
    clean_dout = inputs["dout"][:, :, case.seq_len :]
    shares = [draw(*clean_dout.shape) for _ in range(case.num_rings - 1)]
    inputs["clean_dout_by_ring"] = torch.stack(shares + [clean_dout - sum(shares, torch.zeros_like(clean_dout))])
    return inputs


def run_cases(rank: int, world_size: int, cases: tuple[TransportCase, ...]) -> list[dict]:
    """Worker: run every case on this rank; return its rows' results and traffic."""
    return [_run_case(rank, world_size, case) for case in cases]


UNEVEN_SHARDS = (((0, 3, 7), (0, 10)), ((1, 2, 4, 5, 6), (10, 16)))  # per rank: noisy blocks, clean range


def uneven_layouts(block_size: int) -> list[RankLayout]:
    """Two ranks of ``L = 16``: clean shards ``[0, 10)`` and ``[10, 16)`` (the wire pads to 10 rows)."""
    layouts = []
    for blocks, (clean_lo, clean_hi) in UNEVEN_SHARDS:
        noisy = torch.cat([torch.arange(b * block_size, (b + 1) * block_size) for b in blocks])
        clean = torch.arange(clean_lo, clean_hi)
        rows = bd3_rows(noisy, clean, block_size=block_size)
        layouts.append(RankLayout(rows, len(noisy), noisy, clean, blocks))
    return layouts


def _build(case: TransportCase, local_rank: int, comm: Comm):
    """``(layout, attention)`` of one rank for ``case``."""
    if case.uneven_clean_shards:
        layouts = uneven_layouts(case.block_size)
        layout = layouts[local_rank]
        spec = ExchangeSpec(local_rank, layout.num_noisy, tuple(m.rows.select(slice(m.num_noisy, None)) for m in layouts))
        transport = {"collective": CollectiveAttention, "streaming": StreamingAttention}[case.transport]
        return layout, transport(layout, spec, comm, causal_in_block=case.causal_in_block)
    layout = rank_layout(
        case.topology, local_rank, case.seq_len, case.block_size, schedule=case.schedule, window=case.window
    )
    attention = build_attention(
        case.topology, local_rank, layout, comm, block_size=case.block_size, transport=case.transport,
        window=case.window, causal_in_block=case.causal_in_block, schedule=case.schedule,
    )
    return layout, attention


def _run_case(rank: int, world_size: int, case: TransportCase) -> dict:
    groups = build_process_groups(case.topology)
    coords = groups.coords
    counter = TrafficCounter()
    layout, attention = _build(case, coords.local_rank, Comm(groups.ring, counter))
    inputs = reference_inputs(case)
    index = torch.cat([layout.noisy_positions, case.seq_len + layout.clean_positions])
    dtype = case.torch_dtype
    q, k, v = (inputs[name][:, :, index].to(dtype).requires_grad_(True) for name in ("q", "k", "v"))
    out = attention(q, k, v, 0)
    forward_traffic = counter.snapshot()
    dout = inputs["dout"][:, :, index].clone()
    dout[:, :, layout.num_noisy :] = inputs["clean_dout_by_ring"][coords.ring_index][:, :, layout.clean_positions]
    out.backward(dout.to(dtype))
    assert out.dtype == q.grad.dtype == k.grad.dtype == v.grad.dtype == dtype
    return {
        "index": index,
        "num_noisy": layout.num_noisy,
        "owned_blocks": layout.owned_blocks,
        "ctx_stop": layout.rows.ctx_stop,
        "ring_index": coords.ring_index,
        "out": out.detach().double(),
        "dq": q.grad.double(),
        "dk": k.grad.double(),
        "dv": v.grad.double(),
        "forward_traffic": forward_traffic,
        "traffic": counter.snapshot(),
    }


@functools.cache
def launch(world_size: int) -> dict[TransportCase, list[dict]]:
    """Run every case of ``world_size`` on ``world_size`` gloo processes; results per case, by rank."""
    cases = CASES_BY_WORLD[world_size]
    per_rank = run_local(run_cases, world_size, (cases,), timeout_s=240.0)
    return {case: [per_rank[r][i] for r in range(world_size)] for i, case in enumerate(cases)}


def results_of(case: TransportCase) -> list[dict]:
    return launch(case.world_size)[case]


def cases_with(**fields) -> list[TransportCase]:
    """Every registered case whose fields equal ``fields``."""
    return [
        case for cases in CASES_BY_WORLD.values() for case in cases
        if all(getattr(case, name) == value for name, value in fields.items())
    ]


def case_id(case: TransportCase) -> str:
    extra = "".join(
        [f"-W{case.window}" if case.window else "", "-causal" if case.causal_in_block else "",
         "-contiguous" if case.schedule == "contiguous" else "", "" if case.dtype == "float64" else f"-{case.dtype}",
         "-uneven" if case.uneven_clean_shards else ""]
    )
    return f"L{case.seq_len}B{case.block_size}-cp{case.cp}bp{case.bp}-{case.transport}{extra}"


@functools.cache
def reference_results(case: TransportCase) -> dict[str, torch.Tensor]:
    """Single-process ``LocalAttentionFn`` on ``reference_layout``, checked against dense softmax, in
    float64 from the inputs rounded to the case's dtype (so only the transport's rounding remains)."""
    inputs = {name: t.to(case.torch_dtype).double() for name, t in reference_inputs(case).items()}
    rows = reference_layout(case.seq_len, case.block_size, case.window).rows
    attention = LocalAttentionFn(rows, num_noisy=case.seq_len, causal_in_block=case.causal_in_block)
    results = {}
    for name, fn in (("local", attention), ("dense", functools.partial(_dense_attention, rows=rows, case=case))):
        q, k, v = (inputs[n].clone().requires_grad_(True) for n in ("q", "k", "v"))
        out = fn(q, k, v, 0)
        out.backward(inputs["dout"])
        results[name] = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    for name in ("out", "dq", "dk", "dv"):
        torch.testing.assert_close(results["local"][name], results["dense"][name], **TOL)
    return results["local"]


def _dense_attention(q, k, v, layer_index, *, rows, case: TransportCase) -> torch.Tensor:
    group = q.shape[1] // k.shape[1]
    allow = allow_matrix(rows, rows, causal_in_block=case.causal_in_block)  # every row sees a key
    scores = q @ k.repeat_interleave(group, 1).transpose(-1, -2) / math.sqrt(q.shape[-1])
    probs = torch.softmax(scores.masked_fill(~allow, float("-inf")), dim=-1)
    return probs @ v.repeat_interleave(group, 1)


def assert_matches_reference(case: TransportCase, results: list[dict]) -> None:
    """Every rank's outputs equal the reference at its rows; gradients summed over the ranks holding
    a row (noisy rows: exactly one; clean rows: one replica per ring) equal the reference."""
    reference = reference_results(case)
    num_rows = 2 * case.seq_len
    totals = {name: torch.zeros_like(reference[name]) for name in ("dq", "dk", "dv")}
    holders = torch.zeros(num_rows, dtype=torch.long)
    for rank, result in enumerate(results):
        index = result["index"]
        assert torch.isfinite(result["out"]).all(), f"rank {rank}: non-finite output"
        torch.testing.assert_close(
            result["out"], reference["out"][:, :, index], **case.tolerance, msg=f"rank {rank} out"
        )
        for name in totals:
            totals[name].index_add_(2, index, result[name])
        holders.index_add_(0, index, torch.ones_like(index))
    assert torch.equal(holders[: case.seq_len], torch.ones(case.seq_len, dtype=torch.long)), "noisy rows once"
    assert torch.equal(holders[case.seq_len :], torch.full((case.seq_len,), case.num_rings)), "clean replicas"
    for name, total in totals.items():
        torch.testing.assert_close(total, reference[name], **case.tolerance, msg=f"{name} of {case_id(case)}")


def forward_bytes(result: dict) -> int:
    return result["forward_traffic"].get("attention", {}).get("bytes", 0)


def backward_bytes(result: dict, category: str = "attention") -> int:
    total = result["traffic"].get(category, {}).get("bytes", 0)
    before = result["forward_traffic"].get(category, {}).get("bytes", 0)
    return total - before


def collective_bytes_expected(case: TransportCase, *, gradients: bool = False) -> int:
    """csbp.md §12 (zigzag shards are equal, so no padding): ``(CP-1)/CP * L`` rows of K and V per
    rank per layer for CSBP, all-gathered; the CP-only baseline exchanges ``2L/CP`` rows per rank.
    ``gradients``: the same rows of dK/dV (accumulation dtype) reduce-scattered in the backward."""
    if case.uneven_clean_shards:
        shard_rows = max(hi - lo for _, (lo, hi) in UNEVEN_SHARDS)  # every rank sends the padded shard
    else:
        shard_rows = case.seq_len // case.cp if case.bp > 1 else 2 * case.seq_len // case.cp
    return (case.cp - 1) * shard_rows * (case.grad_row_bytes if gradients else case.kv_row_bytes)


COLLECTIVE_CASES = cases_with(transport="collective", window=None)


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", COLLECTIVE_CASES, ids=case_id)
def test_collective_matches_reference(case: TransportCase) -> None:
    assert_matches_reference(case, results_of(case))


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", COLLECTIVE_CASES, ids=case_id)
def test_collective_byte_identities(case: TransportCase) -> None:
    """Forward all-gather and backward reduce-scatter bytes per rank per layer (csbp.md §18 item 10)."""
    expected = collective_bytes_expected(case)
    for rank, result in enumerate(results_of(case)):
        assert forward_bytes(result) == expected, f"rank {rank} forward"
        assert backward_bytes(result) == collective_bytes_expected(case, gradients=True), f"rank {rank} backward"
        assert set(result["traffic"]) == {"attention"}, "every byte is in the attention category"


@pytest.mark.multiprocess
def test_cp_only_moves_exactly_twice_the_csbp_bytes() -> None:
    for cp, block_size in ((2, 4), (4, 2)):
        csbp_case = TransportCase(32, block_size, cp, cp)
        csbp_bytes = (cp - 1) * (32 // cp) * csbp_case.kv_row_bytes  # (CP-1)/CP * L rows of K and V
        cp_only = results_of(TransportCase(32, block_size, cp, 1))
        csbp = results_of(csbp_case)
        assert {forward_bytes(r) for r in csbp} == {backward_bytes(r) for r in csbp} == {csbp_bytes}
        assert {forward_bytes(r) for r in cp_only} == {backward_bytes(r) for r in cp_only} == {2 * csbp_bytes}


@pytest.mark.multiprocess
def test_rank_owning_only_the_first_block_sees_no_clean_context() -> None:
    """The rank whose only block is block 0 has empty clean context on every noisy row and still
    matches the reference (zeros from the clean part, no NaN)."""
    results = results_of(FIRST_BLOCK_CASE)
    first = [r for r in results if r["owned_blocks"] == (0,)]
    assert len(first) == 1
    assert int(first[0]["ctx_stop"][: first[0]["num_noisy"]].max()) == 0
    assert_matches_reference(FIRST_BLOCK_CASE, results)


def test_unknown_transport_raises() -> None:
    topology = Topology(cp=2, bp=2)
    layout = csbp_layout(32, 4, 2, 2, 0)
    with pytest.raises(ValueError, match="transport.*'collective', 'streaming'.*'ring'"):
        build_attention(topology, 0, layout, Comm(None), block_size=4, transport="ring")


def test_layout_transport_mismatch_raises() -> None:
    with pytest.raises(ValueError, match="zigzag clean shard"):  # a CP-only layout under a CSBP topology
        build_attention(Topology(cp=2, bp=2), 0, cp_zigzag_layout(32, 4, 2, 0), None, block_size=4)
    with pytest.raises(ValueError, match="CP zigzag rows"):  # another rank's layout
        build_attention(Topology(cp=2), 0, cp_zigzag_layout(32, 4, 2, 1), None, block_size=4)
    with pytest.raises(ValueError, match="CP-only zigzag layout"):  # a CSBP layout under a CP topology
        build_attention(Topology(cp=2), 0, csbp_layout(32, 4, 2, 4, 0), None, block_size=4)


def test_missing_or_wrong_ring_comm_raises() -> None:
    layout = csbp_layout(32, 4, 2, 2, 0)
    with pytest.raises(ValueError, match="comm=None"):
        build_attention(Topology(cp=2, bp=2), 0, layout, None, block_size=4)
    with pytest.raises(ValueError, match="ring"):
        build_attention(Topology(cp=2, bp=2), 0, layout, Comm(None), block_size=4)


def test_local_layouts_need_no_comm() -> None:
    """data and BP-only layouts get local attention (no communication)."""
    topology = Topology(bp=2, replicate_clean_prefix=True)
    layout = rank_layout(topology, 1, 16, 4)
    attention = build_attention(topology, 1, layout, None, block_size=4)
    assert isinstance(attention, LocalAttentionFn)


def test_scatter_remote_writes_every_row_once_with_zeros_where_no_remote_key_lands() -> None:
    """The gradient scatter allocates its buffer uninitialised (NaN here) and writes each row once: the
    remote rows' dK/dV, zeros at this member's own slot and at the other members' idle rows (a dead row,
    padding up to the longest shard). Bit-equal to a zero-filled buffer with the stacked dK/dV put in."""
    from csbp.attention.transports.exchange import remote_keys, scatter_remote

    positions = (torch.arange(0, 10), torch.arange(10, 16), torch.arange(16, 24))  # shards of 10, 6 and 8 rows
    members = [bd3_rows(torch.zeros(0, dtype=torch.long), p, block_size=2) for p in positions]
    members[2] = replace(members[2], live=torch.arange(8) != 3)  # one dead row in a full-length shard
    spec = ExchangeSpec(ring_rank=1, exchange_start=0, member_rows=tuple(members))
    remote = remote_keys(spec)
    assert len(remote) == 17 and sorted(zip(remote.idle_owner.tolist(), remote.idle_row.tolist())) == [
        (2, 3), (2, 8), (2, 9),
    ]
    gen = torch.Generator().manual_seed(0)
    dk, dv = (torch.randn(2, 3, len(remote), 4, generator=gen) for _ in "kv")
    with pytest.MonkeyPatch.context() as patch:
        torch.use_deterministic_algorithms(True)
        patch.setattr(torch.utils.deterministic, "fill_uninitialized_memory", True)
        try:
            got = scatter_remote(dk, dv, remote, spec.ring_rank, spec.ring_size, spec.shard_rows)
        finally:
            torch.use_deterministic_algorithms(False)
    want = torch.zeros(3, 2 * 6, 10, 4)
    lanes = torch.arange(12)
    want[remote.owner[None, :], lanes[:, None], remote.row[None, :]] = torch.stack([dk, dv]).reshape(12, -1, 4)
    assert torch.equal(got, want.view(6, 2, 3, 10, 4))
    # a kernel's bf16 dK/dV go out in the accumulation dtype the ring sums in, with the same values
    low = scatter_remote(dk.bfloat16(), dv.bfloat16(), remote, spec.ring_rank, spec.ring_size, spec.shard_rows,
                         dtype=torch.float32)
    assert low.dtype == torch.float32 and torch.equal(low, want.view(6, 2, 3, 10, 4).bfloat16().float())
