"""Local attention: every key row is on this process, so there is no communication (csbp.md §5.3,
§9.1). Used by the single-process reference and by BP-only ranks (clean-prefix replication).

Queries and keys are the same packed rows ``[noisy rows ; clean rows]``. When the noisy rows are
whole blocks (each block once, all live, ``B`` rows each, increasing positions inside a block if
``causal_in_block``), attention is computed as two partials merged online:

* noisy rows x noisy keys: ``backends.plan_block_diagonal`` (the ``csbp.attention.diagonal`` kernel:
  on ``tiles`` one batched fused SDPA call by default for B >= 16, batched matmuls below);
* all rows x clean keys: ``interval_attention_forward`` with a tile plan built once.

Otherwise (or when separate ``key_rows`` are given, or on the ``flex`` backend with the ``flex``
diagonal, whose one BlockMask over the mixed mask skips the empty blocks itself) one partial over
all keys is used. Backward computes both parts
from the final merged ``(out, lse)``. Partials run on the chosen backend
(``csbp.attention.backends``). One FlexAttention partial has nothing to merge: it runs under torch's
own autograd (``flex.flex_autograd_attention``), so its backward needs no recomputed forward.

Usage::

    attn = LocalAttentionFn(rows, num_noisy=A)     # once per shape (rows are the same in every layer)
    out = attn(q, k, v, layer_index)               # q [S, Hq, N, d], k/v [S, Hkv, N, d] -> [S, Hq, N, d]

The plan is built once per device the inputs arrive on (``exchange.PlanCache``): rows given on the
CPU serve calls on a GPU, with every index and row tensor of the plan on that GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from csbp.attention import kept_forwards
from csbp.attention.backends import PartialPlan, plan_block_diagonal, plan_partial, resolve_backend
from csbp.attention.diagonal import resolve_diagonal
from csbp.attention.flex import FlexPartial, flex_autograd_attention
from csbp.attention.kernel import DEFAULT_TILE_ROWS
from csbp.attention.merge import accumulation_dtype, merge_into, row_delta
from csbp.attention.rows import Rows
from csbp.attention.transports.exchange import PlanCache
from csbp.attention.transports.function import TransportFunction, exact_attention_precision


@dataclass(frozen=True, eq=False)
class LocalAttentionPlan:
    """Everything local attention needs besides q/k/v; build with ``build_local_attention_plan``.

    Attributes:
        query_rows: the query rows (``[noisy ; clean]``).
        key_rows: the key rows (the query rows unless given separately).
        num_noisy: leading noisy query rows.
        block_size: ``B`` when the block-diagonal fast path is used, else None.
        causal_in_block: lower-triangular block-diagonal part.
        scale: softmax scale (None: ``1/sqrt(d)``).
        interval_plan: the interval partial: queries x clean keys on the fast path, queries x all
            keys otherwise.
        block_plan: the block-diagonal partial of the noisy rows (fast path only).
    """

    query_rows: Rows
    key_rows: Rows
    num_noisy: int
    block_size: int | None
    causal_in_block: bool
    scale: float | None
    interval_plan: PartialPlan
    block_plan: PartialPlan | None = None


def build_local_attention_plan(
    rows: Rows,
    *,
    num_noisy: int,
    key_rows: Rows | None = None,
    causal_in_block: bool = False,
    scale: float | None = None,
    tile_rows: int = DEFAULT_TILE_ROWS,
    backend: str = "tiles",
    diagonal: str = "auto",
    clean: str = "generic",
) -> LocalAttentionPlan:
    """Plan attention of ``rows`` (``num_noisy`` noisy rows, then clean rows) over ``key_rows``
    (default: the same rows, which enables the block-diagonal fast path of the tiles backend, and on
    ``flex`` the decomposed form when ``diagonal`` is not ``flex``; ``csbp.attention.diagonal``). ``clean``
    runs the clean-key partial (``csbp.attention.backends.CLEAN_KERNELS``; with whole noisy blocks)."""
    if not 0 <= num_noisy <= len(rows):
        raise ValueError(f"num_noisy={num_noisy} must be in [0, {len(rows)}] (the number of rows)")
    if bool(rows.clean[:num_noisy].any()) or not bool(rows.clean[num_noisy:].all()):
        raise ValueError(
            f"rows must be packed [noisy ; clean]: rows[:num_noisy={num_noisy}] noisy (clean=False) and the "
            "rest clean; fix num_noisy or the row order"
        )
    block_size = None
    backend = resolve_backend(backend, rows.pos.device)
    if key_rows is None:
        key_rows = rows
        if backend == "tiles" or resolve_diagonal(diagonal, backend) != "flex":
            block_size = _whole_block_size(rows.select(slice(0, num_noisy)), causal_in_block)
    interval_keys = key_rows if block_size is None else key_rows.select(slice(num_noisy, None))
    block_plan = None
    if block_size is not None and num_noisy > 0:
        block_plan = plan_block_diagonal(
            rows.select(slice(0, num_noisy)), block_size=block_size, backend=backend, causal_in_block=causal_in_block,
            diagonal=diagonal,
        )
    return LocalAttentionPlan(
        query_rows=rows,
        key_rows=key_rows,
        num_noisy=num_noisy,
        block_size=block_size,
        causal_in_block=causal_in_block,
        scale=scale,
        interval_plan=plan_partial(
            rows, interval_keys, backend=backend, causal_in_block=causal_in_block, tile_rows=tile_rows, clean=clean
        ),
        block_plan=block_plan,
    )


def local_attention_forward(
    q: Tensor, k: Tensor, v: Tensor, plan: LocalAttentionPlan, *, kernel_dtype: bool = False
) -> tuple[Tensor, Tensor]:
    """``(out [S, Hq, N, d], lse [S, Hq, N])`` in the accumulation dtype; with ``kernel_dtype`` (a caller
    that casts ``out`` to q's dtype and merges nothing into it: the autograd Function) one partial's
    ``out`` may stay in its kernels' dtype."""
    if plan.block_size is None:
        return plan.interval_plan.forward(q, k, v, scale=plan.scale, kernel_dtype=kernel_dtype)
    num_noisy = plan.num_noisy
    out, lse = plan.interval_plan.forward(q, k[:, :, num_noisy:], v[:, :, num_noisy:], scale=plan.scale)
    if plan.block_plan is None:
        return out, lse
    noisy = slice(0, num_noisy)
    out_block, lse_block = plan.block_plan.forward(q[:, :, noisy], k[:, :, noisy], v[:, :, noisy], scale=plan.scale)
    merge_into(out[:, :, noisy], lse[:, :, noisy], out_block, lse_block)
    return out, lse


def local_attention_backward(
    q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor, plan: LocalAttentionPlan, *,
    kernel_dtype: bool = False, delta: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` in the accumulation dtype from the final ``out``/``lse`` and ``dout``; with
    ``kernel_dtype`` (a caller that casts them to the inputs' dtypes, adding nothing or one more partial's
    once, in place, which computes in fp32 and rounds once: the autograd Function, the collective ring)
    one partial's may stay in its kernels' dtype, with no cast pass either way. ``delta =
    rowsum(dout * out)`` is the ring transports' (shared with their remote partials); otherwise one
    partial forms its own (a direct Flex backward inside its compiled call, fused), two share one."""
    dtype = accumulation_dtype(q, k, v)
    if delta is None and plan.block_size is not None:
        delta = row_delta(dout, out, dtype)  # [S, Hq, N], for both partials
    if plan.block_size is None:
        return plan.interval_plan.backward(
            q, k, v, out, lse, dout, scale=plan.scale, delta=delta, kernel_dtype=kernel_dtype
        )
    num_noisy = plan.num_noisy
    dq, dk_clean, dv_clean = plan.interval_plan.backward(
        q, k[:, :, num_noisy:], v[:, :, num_noisy:], out, lse, dout, scale=plan.scale, delta=delta
    )
    if plan.block_plan is None:
        return dq, dk_clean, dv_clean
    noisy = slice(0, num_noisy)
    dq_block, dk_block, dv_block = plan.block_plan.backward(
        q[:, :, noisy],
        k[:, :, noisy],
        v[:, :, noisy],
        out[:, :, noisy],
        lse[:, :, noisy],
        dout[:, :, noisy],
        scale=plan.scale,
        delta=delta[:, :, noisy],
    )
    dq[:, :, noisy] += dq_block
    return dq, torch.cat([dk_block, dk_clean], dim=2), torch.cat([dv_block, dv_clean], dim=2)


def local_attention(q: Tensor, k: Tensor, v: Tensor, plan: LocalAttentionPlan) -> Tensor:
    """``out`` in the dtype of ``q``, with the explicit backward of ``local_attention_backward``; or,
    when the plan is one FlexAttention partial (the flex backend's default, one BlockMask over the
    mixed mask: nothing to merge) on CUDA, that call under torch's own autograd, whose backward reuses
    the ``out``/``lse`` its forward saved (on the CPU, where FlexAttention's autograd refuses inputs that
    need gradients, ``csbp verify`` runs it through the explicit backward instead)."""
    if (
        plan.block_size is None and isinstance(plan.interval_plan, FlexPartial) and _flex_autograd_runs_on(q.device)
        and not kept_forwards.is_active()  # selective checkpointing replays only through TransportFunction
    ):
        with exact_attention_precision(q.device):
            return flex_autograd_attention(q, k, v, plan.interval_plan, scale=plan.scale)
    return local_attention_function(q, k, v, plan)


def local_attention_function(q: Tensor, k: Tensor, v: Tensor, plan: LocalAttentionPlan) -> Tensor:
    """``out`` in q's dtype through the transport's autograd Function (forward, explicit backward from the
    merged statistics, its gradients cast to the inputs' dtypes), whatever the plan."""
    return TransportFunction.apply(q, k, v, plan, _forward_in_kernel_dtype, _backward_in_kernel_dtype)


def _forward_in_kernel_dtype(q: Tensor, k: Tensor, v: Tensor, plan: LocalAttentionPlan) -> tuple[Tensor, Tensor]:
    return local_attention_forward(q, k, v, plan, kernel_dtype=True)


def _backward_in_kernel_dtype(
    q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor, plan: LocalAttentionPlan
) -> tuple[Tensor, Tensor, Tensor]:
    return local_attention_backward(q, k, v, out, lse, dout, plan, kernel_dtype=True)


def _flex_autograd_runs_on(device: torch.device) -> bool:
    """FlexAttention's own autograd needs CUDA (it refuses CPU inputs that require grad)."""
    return device.type == "cuda"


class LocalAttentionFn:
    """Attention callable for a fixed row set (the decoder's ``AttentionFn``): ``attn(q, k, v) -> out``.

    Build once per step; every layer reuses the plan (one per device the inputs arrive on, so
    ``backend="auto"`` resolves on the compute device). Arguments as in ``build_local_attention_plan``;
    ``device`` is where the plan is built now, the compute device (default: the rows' device): rows on
    the CPU for a GPU run then cost no CPU plan that no call would use.
    """

    def __init__(
        self,
        rows: Rows,
        *,
        num_noisy: int,
        key_rows: Rows | None = None,
        causal_in_block: bool = False,
        scale: float | None = None,
        tile_rows: int = DEFAULT_TILE_ROWS,
        backend: str = "tiles",
        diagonal: str = "auto",
        clean: str = "generic",
        device: torch.device | str | None = None,
    ) -> None:
        def build(device: torch.device) -> LocalAttentionPlan:
            return build_local_attention_plan(
                rows.to(device),
                num_noisy=num_noisy,
                key_rows=None if key_rows is None else key_rows.to(device),
                causal_in_block=causal_in_block,
                scale=scale,
                tile_rows=tile_rows,
                backend=backend,
                diagonal=diagonal,
                clean=clean,
            )

        plan_device = rows.pos.device if device is None else torch.device(device)
        self._plans = PlanCache(build, plan_device)
        self.plan = self._plans.get(plan_device)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, layer_index: int = 0) -> Tensor:
        return local_attention(q, k, v, self._plans.get(q.device))


def _whole_block_size(noisy: Rows, causal_in_block: bool) -> int | None:
    """``B`` when the noisy rows are whole blocks of ``B`` rows (each block once, all live, and
    increasing positions inside a block when causal), else None."""
    if len(noisy) == 0 or not bool(noisy.live.all()):
        return None
    blocks, counts = torch.unique_consecutive(noisy.block, return_counts=True)
    block_size = int(counts[0])
    if not bool((counts == block_size).all()) or torch.unique(blocks).shape[0] != blocks.shape[0]:
        return None
    if causal_in_block and not bool((noisy.pos.view(-1, block_size).diff(dim=1) > 0).all()):
        return None
    return block_size
