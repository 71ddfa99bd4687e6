"""Mask predicates: golden matrices, interval-form (``Rows``) equivalence and FlexAttention parity."""

from __future__ import annotations

import warnings

import pytest
import torch

from csbp.attention.rows import Rows, allow_matrix
from csbp.masks import bd3_mask, dense_mask, dflash_mask, fast_dllm_v2_mask, flex_block_mask, mdlm_mask
from csbp.masks.predicates import MaskMod


def _golden(text: str) -> torch.Tensor:
    rows = [line.strip() for line in text.strip().splitlines()]
    return torch.tensor([[c == "1" for c in row] for row in rows], dtype=torch.bool)


# csbp.md §3.1 / objectives.md §3.2: L = 6, B = 2.
BD3_L6_B2 = _golden("""
11..........
11..........
..11..11....
..11..11....
....111111..
....111111..
......11....
......11....
......1111..
......1111..
......111111
......111111
""")

# Derived by hand from csbp.md §3.3 for L = 6, B = 2, W = 3: noisy block starting at s sees clean
# [max(0, s-2), s) and its own block; clean query p sees clean [max(0, p-2), p+1).
BD3_L6_B2_W3 = _golden("""
11..........
11..........
..11..11....
..11..11....
....11..11..
....11..11..
......1.....
......11....
......111...
.......111..
........111.
.........111
""")

# objectives.md §5.5: S = 8, B = 4, anchors [2, 5]; full attention.
DFLASH_FULL = _golden("""
11......1111....
11......1111....
11......1111....
11......1111....
11111.......1111
11111.......1111
11111.......1111
11111.......1111
""")

# objectives.md §5.5: the same with W = 3, causal inside the block.
DFLASH_W3_CAUSAL = _golden("""
11......1.......
.1......11......
........111.....
........1111....
...11.......1...
....1.......11..
............111.
............1111
""")


def test_bd3_golden_l6_b2():
    assert torch.equal(dense_mask(bd3_mask(6, 2), 12, 12), BD3_L6_B2)


def test_fast_dllm_v2_uses_bd3_predicate():
    assert torch.equal(dense_mask(fast_dllm_v2_mask(6, 2), 12, 12), BD3_L6_B2)


@pytest.mark.parametrize(("seq_len", "block_size"), [(6, 2), (8, 4), (12, 3), (5, 1), (8, 8)])
def test_bd3_allowed_pair_count(seq_len, block_size):
    # csbp.md §3.1: L·B + L² allowed pairs.
    allowed = dense_mask(bd3_mask(seq_len, block_size), 2 * seq_len, 2 * seq_len)
    assert int(allowed.sum()) == seq_len * block_size + seq_len**2


def test_bd3_window_golden_l6_b2_w3():
    assert torch.equal(dense_mask(bd3_mask(6, 2, window=3), 12, 12), BD3_L6_B2_W3)


def test_bd3_false_outside_logical_shape():
    allowed = dense_mask(bd3_mask(4, 2), 12, 12)
    assert torch.equal(allowed[:8, :8], dense_mask(bd3_mask(4, 2), 8, 8))
    assert not allowed[8:].any() and not allowed[:, 8:].any()


def test_mdlm_full_and_documents():
    assert dense_mask(mdlm_mask(5), 5, 5).all()
    doc_ids = torch.tensor([0, 0, 1, 1, 1, 2])
    expected = _golden("""
    11....
    11....
    ..111.
    ..111.
    ..111.
    .....1
    """)
    assert torch.equal(dense_mask(mdlm_mask(6, doc_ids), 6, 6), expected)


def test_dflash_goldens():
    anchors, keep = torch.tensor([2, 5]), torch.tensor([True, True])
    assert torch.equal(dense_mask(dflash_mask(8, 4, anchors, keep), 8, 16), DFLASH_FULL)
    windowed = dflash_mask(8, 4, anchors, keep, window=3, causal_in_block=True)
    assert torch.equal(dense_mask(windowed, 8, 16), DFLASH_W3_CAUSAL)


def test_dflash_dead_block_anchor_zero_and_doc_start():
    anchors, keep = torch.tensor([0, 5, 6]), torch.tensor([True, False, True])
    allowed = dense_mask(dflash_mask(8, 2, anchors, keep, doc_start=torch.tensor([0, 0, 3])), 6, 14)
    expected = _golden("""
    ........11....
    ........11....
    ..............
    ..............
    ...111......11
    ...111......11
    """)
    assert torch.equal(allowed, expected)


def test_dflash_window_non_causal_keeps_whole_block():
    anchors, keep = torch.tensor([2, 5]), torch.tensor([True, True])
    allowed = dense_mask(dflash_mask(8, 4, anchors, keep, window=3), 8, 16)
    assert torch.equal(allowed[:, :8], DFLASH_W3_CAUSAL[:, :8])
    assert torch.equal(allowed[:, 8:], DFLASH_FULL[:, 8:])


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: bd3_mask(6, 4), "multiple of block_size"),
        (lambda: bd3_mask(6, 2, window=0), "window"),
        (lambda: mdlm_mask(4, torch.tensor([0, 1])), "doc_ids"),
        (lambda: dflash_mask(8, 4, torch.tensor([1, 2]), torch.tensor([1, 1])), "keep"),
        (lambda: dflash_mask(8, 4, torch.tensor([1.0]), torch.tensor([True])), "anchors"),
        (lambda: dflash_mask(8, 4, torch.tensor([1]), torch.tensor([True]), doc_start=torch.tensor([0, 0])),
         "doc_start"),
    ],
)
def test_invalid_arguments_raise(build, message):
    with pytest.raises(ValueError, match=message):
        build()


# ---- interval form: the predicate equals attention.rows.allow_matrix on hand-built rows ----------


def _bd3_reference_rows(seq_len: int, block_size: int, window: int | None) -> Rows:
    """All 2L rows of [x_t ; x_0] in interval form (csbp.md §3.2, §3.3)."""
    pos = torch.arange(seq_len)
    block = pos // block_size
    block_start = block * block_size
    if window is None:
        noisy_ctx = (torch.zeros_like(pos), block_start)
        clean_ctx = (torch.zeros_like(pos), (block + 1) * block_size)
    else:
        noisy_ctx = ((block_start - (window - 1)).clamp(min=0), block_start)
        clean_ctx = ((pos + 1 - window).clamp(min=0), pos + 1)
    live = torch.ones(seq_len, dtype=torch.bool)
    noisy = Rows(pos, ~live, block, noisy_ctx[0], noisy_ctx[1], live)
    clean = Rows(pos, live, block, clean_ctx[0], clean_ctx[1], live)
    return Rows.cat([noisy, clean])


@pytest.mark.parametrize("window", [None, 1, 3, 5, 64])
@pytest.mark.parametrize(("seq_len", "block_size"), [(6, 2), (12, 4), (8, 1), (8, 8)])
def test_bd3_equals_interval_rows(seq_len, block_size, window):
    rows = _bd3_reference_rows(seq_len, block_size, window)
    expected = allow_matrix(rows, rows)
    allowed = dense_mask(bd3_mask(seq_len, block_size, window), 2 * seq_len, 2 * seq_len)
    assert torch.equal(allowed, expected)


def test_padded_rows_are_dead_and_padding_never_shrinks():
    """``Rows.padded`` appends dead rows (invisible keys, queries that see nothing); asking for fewer
    rows than there are is a clear ValueError, not a truncation or a torch error."""
    rows = _bd3_reference_rows(4, 2, None)
    assert rows.padded(len(rows)) is rows
    padded = rows.padded(len(rows) + 3)
    assert len(padded) == len(rows) + 3 and not bool(padded.live[len(rows):].any())
    allow = allow_matrix(padded, padded)
    assert torch.equal(allow[: len(rows), : len(rows)], allow_matrix(rows, rows))
    assert not bool(allow[len(rows):].any()) and not bool(allow[:, len(rows):].any())
    with pytest.raises(ValueError, match="cannot pad"):
        rows.padded(len(rows) - 1)


@pytest.mark.parametrize("causal_in_block", [False, True])
@pytest.mark.parametrize("window", [None, 2, 4])
def test_dflash_equals_interval_rows(window, causal_in_block):
    context_len, block_size = 10, 3
    anchors = torch.tensor([0, 4, 7, 9])
    keep = torch.tensor([True, True, False, True])
    doc_start = torch.tensor([0, 0, 5, 5])
    j = torch.arange(block_size).repeat(len(anchors))
    n = torch.arange(len(anchors)).repeat_interleave(block_size)
    q_pos = anchors[n] + j
    ctx_start = doc_start[n]
    if window is not None:
        ctx_start = torch.maximum(ctx_start, q_pos - (window - 1))
    no = torch.zeros_like(n, dtype=torch.bool)
    queries = Rows(q_pos, no, n, ctx_start, anchors[n], keep[n])
    ctx_pos = torch.arange(context_len)
    context_keys = Rows(ctx_pos, torch.ones(context_len, dtype=torch.bool), ctx_pos // block_size,
                        ctx_pos, ctx_pos, torch.ones(context_len, dtype=torch.bool))
    keys = Rows.cat([context_keys, Rows(q_pos, no, n, q_pos, q_pos, ~no)])
    expected = allow_matrix(queries, keys, causal_in_block=causal_in_block)
    mask_mod = dflash_mask(context_len, block_size, anchors, keep, window, causal_in_block, doc_start)
    assert torch.equal(dense_mask(mask_mod, len(queries), len(keys)), expected)


def test_mdlm_documents_equal_interval_rows():
    doc_ids = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2])
    pos = torch.arange(8)
    live = torch.ones(8, dtype=torch.bool)
    rows = Rows(pos, ~live, doc_ids, pos, pos, live)  # noisy rows, block id = document, no context
    assert torch.equal(dense_mask(mdlm_mask(8, doc_ids), 8, 8), allow_matrix(rows, rows))


# ---- FlexAttention: BlockMask structure and forward parity ---------------------------------------

FLEX_CASES = [
    ("bd3", lambda: bd3_mask(8, 2), 16, 16),
    ("bd3_window", lambda: bd3_mask(8, 2, window=3), 16, 16),
    ("mdlm_docs", lambda: mdlm_mask(16, torch.tensor([0] * 5 + [1] * 7 + [2] * 4)), 16, 16),
    ("dflash", lambda: dflash_mask(8, 4, torch.tensor([2, 5]), torch.tensor([True, True])), 8, 16),
    ("dflash_dead_window", lambda: dflash_mask(8, 4, torch.tensor([3, 6]), torch.tensor([False, True]),
                                               window=3, causal_in_block=True), 8, 16),
]


def _element_mask_from_block_mask(block_mask, mask_mod: MaskMod, q_len: int, kv_len: int) -> torch.Tensor:
    """Element-level mask the kernel applies: full tiles True, partial tiles ``mask_mod``, others False."""
    tile_q, tile_kv = block_mask.BLOCK_SIZE
    elementwise = dense_mask(mask_mod, q_len, kv_len)
    result = torch.zeros(q_len, kv_len, dtype=torch.bool)
    for qi in range(q_len // tile_q):
        rows = slice(qi * tile_q, (qi + 1) * tile_q)
        for t in block_mask.kv_indices[0, 0, qi, : block_mask.kv_num_blocks[0, 0, qi]].tolist():
            cols = slice(t * tile_kv, (t + 1) * tile_kv)
            result[rows, cols] = elementwise[rows, cols]
        for t in block_mask.full_kv_indices[0, 0, qi, : block_mask.full_kv_num_blocks[0, 0, qi]].tolist():
            result[rows, t * tile_kv : (t + 1) * tile_kv] = True
    return result


@pytest.mark.parametrize(("name", "build", "q_len", "kv_len"), FLEX_CASES, ids=[c[0] for c in FLEX_CASES])
def test_flex_block_mask_matches_dense(name, build, q_len, kv_len):
    mask_mod = build()
    tile = 4
    block_mask = flex_block_mask(mask_mod, q_len, kv_len, block=tile)
    dense = dense_mask(mask_mod, q_len, kv_len)
    tiles = dense.reshape(q_len // tile, tile, kv_len // tile, tile).permute(0, 2, 1, 3).flatten(2)
    assert torch.equal(block_mask.to_dense()[0, 0].bool(), tiles.any(-1))
    full = torch.zeros_like(tiles[..., 0])
    for qi in range(q_len // tile):
        full[qi, block_mask.full_kv_indices[0, 0, qi, : block_mask.full_kv_num_blocks[0, 0, qi]]] = True
    assert torch.equal(full, tiles.all(-1))
    assert torch.equal(_element_mask_from_block_mask(block_mask, block_mask.mask_mod, q_len, kv_len), dense)


def _dense_masked_attention(q, k, v, allowed):
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows without keys output zeros
    return probs @ v


@pytest.mark.parametrize(("name", "build", "q_len", "kv_len"), FLEX_CASES, ids=[c[0] for c in FLEX_CASES])
def test_flex_attention_forward_matches_dense_softmax(name, build, q_len, kv_len):
    from torch.nn.attention.flex_attention import flex_attention

    mask_mod = build()
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, q_len, 8, generator=generator)
    k = torch.randn(2, 3, kv_len, 8, generator=generator)
    v = torch.randn(2, 3, kv_len, 8, generator=generator)
    block_mask = flex_block_mask(mask_mod, q_len, kv_len, block=4)
    with warnings.catch_warnings():  # a failure fails: it turned every error, a wrong mask's too, into a skip
        warnings.simplefilter("ignore", UserWarning)  # "called without torch.compile" notice
        out = flex_attention(q, k, v, block_mask=block_mask)
    expected = _dense_masked_attention(q, k, v, dense_mask(mask_mod, q_len, kv_len))
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
