"""The backward of a FlexAttention partial from the merged statistics, and which way it runs (csbp.md §9.2).

csbp's transports split attention into partials over key sets and merge them in fp32, so a
partial's backward is handed the *merged* ``(out, lse)`` and ``dout``, as in FlashAttention's ring
attention. FlexAttention's autograd only knows its own call's statistics, so there are two ways:

* ``direct``: FlexAttention's own backward kernel (the ``flex_attention_backward`` operator) called
  with the merged statistics, ``torch.compile``-d once per shape bucket. With ``P = exp(s - lse)``
  over the merged ``lse`` the kernel computes exactly this partial's share of the merged softmax;
  the row term ``delta = <dout, out>`` of the merged ``out`` enters through the kernel's lse gradient
  (``out`` is passed as zeros, ``grad_lse = -delta``), so it stays in the accumulation dtype (the
  kernel's own would be rounded to bf16). A partial whose caller hands no ``delta`` (the local
  transport: one partial) forms it inside the compiled call from the merged ``out``, fused into one
  pass; the ring transports form one for all their partials. One
  backward kernel per partial and no forward. It needs a torch whose dynamo traces a direct call of
  that operator: csbp hands it the score and mask functions as FX graphs one level down a dict, the
  form compiled autograd uses, which torch 2.11's dynamo requires and 2.13's accepts (both tested).
* ``recompute``: the partial's forward again under autograd, then the chain rule through the merge
  (``merge.partial_grads_from_merged``); one extra forward per backward (by FlashAttention's usual
  backward/forward cost ratio of 2.5-3, roughly a quarter more attention time).

``attention.flex_backward`` picks one: ``auto`` (``direct`` where the installed torch traces it, else
``recompute``), ``direct`` (refused on a torch that cannot trace it) or ``recompute``. The choice is
process-wide (a compiler failure of the direct call stops with one line naming ``recompute``; csbp
never switches by itself), like torch's own SDPA kernel selection: ``set_flex_backward`` at a run's start,
``flex_backward_mode`` as a context manager (benchmarks, tests). Both ways give the same gradients
(float64 tests against the dense reference); the single flex call of the local transport needs
neither (``flex.flex_autograd_attention``).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Literal, get_args

import torch
from torch import Tensor

if TYPE_CHECKING:
    from torch.fx import GraphModule
    from torch.nn.attention.flex_attention import BlockMask

FlexBackwardName = Literal["auto", "direct", "recompute"]
FLEX_BACKWARDS: tuple[str, ...] = get_args(FlexBackwardName)

FLEX_RECOMPILE_LIMIT = 128
"""Graphs dynamo may keep per compiled flex function: one per shape (the partials of one run have a
handful: local, remote, per ring step, per DFlash packet bucket, two per doubling of a partial whose
size changes, see ``flex.flex_shape_bucket``; times grad mode and dtype). Past dynamo's default of 8
it would silently run the unfused eager path; past this limit csbp stops with one line instead
(``fail_on_recompile_limit_hit``)."""

_mode: str = "auto"

FLEX_MIN_HEAD_DIM = 16
"""Narrowest head FlexAttention's CUDA kernel takes (Triton's ``tl.dot`` needs K >= 16; inductor refuses
``NYI: embedding dimension ... must be at least 16``): narrower heads (the verification model's 8) run
zero-padded to it, on every device (``pad_head_dim``)."""


def pad_head_dim(x: Tensor) -> Tensor:
    """``x [..., d]`` with zero columns up to ``FLEX_MIN_HEAD_DIM`` (``x`` itself when ``d`` is at least that).
    Exact: zero query/key columns add nothing to a score and zero value columns give zero output columns
    (dropped again), and their gradients are dropped with them."""
    missing = FLEX_MIN_HEAD_DIM - x.shape[-1]
    return torch.nn.functional.pad(x, (0, missing)) if missing > 0 else x


def configure_recompile_limits() -> None:
    """Raise dynamo's recompile limits to ``FLEX_RECOMPILE_LIMIT`` and make hitting them an error."""
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, FLEX_RECOMPILE_LIMIT)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 2 * FLEX_RECOMPILE_LIMIT)
    if hasattr(config, "fail_on_recompile_limit_hit"):  # never fall back to the dense eager path silently
        config.fail_on_recompile_limit_hit = True


def recompile_limit_error(error: Exception, q: Tensor, k: Tensor) -> RuntimeError | None:
    """One clear error for dynamo's recompile limit (None for any other error)."""
    if type(error).__name__ not in ("FailOnRecompileLimitHit", "RecompileLimitExceeded"):
        return None
    return RuntimeError(
        f"FlexAttention needed more than {torch._dynamo.config.recompile_limit} compiled shapes (this call: q "
        f"{tuple(q.shape)}, k {tuple(k.shape)}, {q.dtype}); csbp pads partials to shape buckets, so this run "
        "mixes unusually many shapes: set attention.backend: tiles, or raise "
        "csbp.attention.flex_backward.FLEX_RECOMPILE_LIMIT"
    )


# ----------------------------------------------------------------------------- which way


def check_flex_backward(name: str, *, where: str = "attention.flex_backward") -> str:
    """``name`` if it is a flex backward mode, else one clear ``ValueError``."""
    if name not in FLEX_BACKWARDS:
        raise ValueError(f"{where} must be one of {FLEX_BACKWARDS}, got {name!r}")
    return name


def resolve_flex_backward(name: str, *, where: str = "attention.flex_backward") -> str:
    """``direct`` or ``recompute`` for ``name``; ``direct`` on a torch that cannot trace it is refused."""
    check_flex_backward(name, where=where)
    if name == "recompute":
        return name
    supported, reason = direct_backward_support()  # probed once per process
    if name == "auto":
        return "direct" if supported else "recompute"
    if name == "direct" and not supported:
        raise ValueError(
            f"{where}=direct needs a torch whose torch.compile traces FlexAttention's backward operator "
            f"(torch 2.11, 2.13 and 2.14.1 do; this is {torch.__version__}: {reason}); set {where} to auto or recompute"
        )
    return name  # direct, supported


def set_flex_backward(name: str, *, where: str = "attention.flex_backward") -> str:
    """Make ``name`` the process's flex backward (checked now); returns the resolved mode."""
    global _mode
    resolved = resolve_flex_backward(name, where=where)
    _mode = name
    return resolved


def current_flex_backward() -> str:
    """The resolved mode (``direct`` or ``recompute``) flex partials use now."""
    return resolve_flex_backward(_mode)


@contextlib.contextmanager
def flex_backward_mode(name: str) -> Iterator[str]:
    """Run a block with flex backward ``name``; yields the resolved mode and restores the previous one."""
    global _mode
    previous = _mode
    resolved = set_flex_backward(name)
    try:
        yield resolved
    finally:
        _mode = previous


@functools.lru_cache(maxsize=1)
def direct_backward_support() -> tuple[bool, str]:
    """Whether dynamo traces a direct call of FlexAttention's backward operator, and why not: a tiny
    compile on the CPU with the ``eager`` backend (dynamo only, no kernel), once per process."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask

        q = torch.zeros(1, 1, 16, 8)
        mask = create_block_mask(_probe_mask, 1, 1, 16, 16, device="cpu", BLOCK_SIZE=16)
        lse = torch.zeros(1, 1, 16)
        grads = _direct_call(q, q, q, lse, q, lse, mask, 1.0, mask_predicate=_probe_mask, mask_buffers=(),
                             backend="eager")
    except Exception as error:  # any failure means: not this torch; the reason goes to the user
        return False, f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}".strip()
    if len(grads) != 3 or grads[0].shape != q.shape:
        return False, "unexpected result of the backward operator"
    return True, "ok"


def _probe_mask(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    return q_idx >= kv_idx


# ----------------------------------------------------------------------------- the direct call


def direct_flex_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lse: Tensor,
    dout: Tensor,
    delta: Tensor | None,
    block_mask: BlockMask,
    scale: float | None,
    *,
    mask_predicate: Callable[..., Tensor],
    mask_buffers: tuple[Tensor, ...],
    out: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` in q's dtype of the partial over ``block_mask`` from the *merged* ``lse``
    (natural log, per query row) and ``delta = <dout, out>`` of the merged ``out``, or, with ``delta``
    None, from the merged ``out`` itself: ``delta`` is then formed inside the compiled call, products and
    sum in the statistics' dtype, one fused pass over ``dout`` and ``out`` instead of the eager
    ``merge.row_delta``'s three (a cast, the product, the sum). All row
    counts are the kernel's (padded) ones; rows whose merged lse is ``-inf`` (they see nothing) get
    zero gradients. ``block_mask``'s mask is ``mask_predicate(b, h, q_idx, kv_idx, *mask_buffers)``
    (a module-level function: its traced graph is kept per shape). Compiled with inductor on CUDA; on
    the CPU (tests) traced by dynamo and run by ``aot_eager`` (FlexAttention has no compiled CPU
    backward)."""
    stats = torch.float64 if q.dtype == torch.float64 else torch.float32
    lse = lse.to(stats)
    lse_log2 = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)) / math.log(2)
    backend = "inductor" if q.device.type == "cuda" else "aot_eager"
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale  # the real head dim's
    dims = (q.shape[-1], k.shape[-1], v.shape[-1])
    q, k, v, dout = (pad_head_dim(x) for x in (q, k, v, dout))  # narrow heads as in the forward (exact)
    if delta is None and out is None:
        raise ValueError("direct_flex_backward needs the merged delta or the merged out it is formed from")
    grad_lse_log2 = None if delta is None else -delta.to(stats) * math.log(2)
    merged_out = None if delta is not None else pad_head_dim(out)  # type: ignore[arg-type]
    try:
        grads = _direct_call(q, k, v, lse_log2, dout.to(q.dtype), grad_lse_log2, block_mask, scale,
                             mask_predicate=mask_predicate, mask_buffers=mask_buffers, backend=backend,
                             merged_out=merged_out)
    except Exception as error:
        replacement = recompile_limit_error(error, q, k) or _compiler_error(error)
        if replacement is None:
            raise
        raise replacement from error
    return tuple(g if g.shape[-1] == dim else g[..., :dim].contiguous() for g, dim in zip(grads, dims))  # type: ignore[return-value]


def _compiler_error(error: Exception) -> RuntimeError | None:
    """One line with the way out when torch's compiler fails on the direct call (None otherwise: out of
    memory and everything else stay as they are)."""
    if not type(error).__module__.startswith(("torch._dynamo", "torch._inductor")):
        return None
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return RuntimeError(
        f"FlexAttention's backward from the merged statistics (attention.flex_backward=direct) failed in torch "
        f"{torch.__version__}'s compiler ({type(error).__name__}: {first}); set attention.flex_backward: recompute"
    )


def _direct_call(
    q: Tensor, k: Tensor, v: Tensor, lse_log2: Tensor, dout: Tensor, grad_lse_log2: Tensor | None,
    block_mask: BlockMask, scale: float, *, mask_predicate: Callable[..., Tensor], mask_buffers: tuple[Tensor, ...],
    backend: str, merged_out: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    from torch.nn.attention.flex_attention import AuxRequest, _apply_kernel_options

    options = _apply_kernel_options(q, k, v, False, None, AuxRequest(lse=True))
    score, joint = _score_graphs(q.device, q.dtype)
    mask = _mask_graph(mask_predicate, q.device, tuple((tuple(b.shape), b.dtype) for b in mask_buffers))
    # each graph one level down a dict: the form dynamo's handler of the backward operator takes (the
    # one compiled autograd hands it); the same objects every call, so no guard fails. Dynamo marks a
    # graph it installed as static (``torchdynamo_force_dynamic = False``), and would then refuse it as
    # an argument of the operator when it compiles the next shape: unmark them
    for graph in (score, joint, mask):
        graph.torchdynamo_force_dynamic = True
    graphs = {"score_graph": {"graph": score}, "joint_graph": {"graph": joint}, "mask_graph": {"graph": mask}}
    return _compiled_backward(backend)(q, k, v, lse_log2, dout, grad_lse_log2, block_mask.as_tuple()[:-1], scale,
                                       options, graphs, mask_buffers, merged_out)


@functools.cache
def _compiled_backward(backend: str) -> Any:
    """The direct backward compiled with ``backend``: one graph per shape bucket (dynamic=False); the
    mask's row tensors are inputs (its buffers), so new rows of the same shapes do not recompile."""
    configure_recompile_limits()
    return torch.compile(_backward_from_statistics, backend=backend, dynamic=False, fullgraph=True)


def _backward_from_statistics(
    q: Tensor, k: Tensor, v: Tensor, lse_log2: Tensor, dout: Tensor, grad_lse_log2: Tensor | None,
    block_mask: tuple[Any, ...], scale: float, options: dict[str, Any], graphs: dict[str, dict[str, GraphModule]],
    mask_buffers: tuple[Tensor, ...], merged_out: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor]:
    from torch._higher_order_ops.flex_attention import flex_attention_backward

    if grad_lse_log2 is None:  # delta = <dout, out> of the merged out, exact products, one fused reduction
        stats = lse_log2.dtype
        grad_lse_log2 = -(dout.to(stats) * merged_out.to(stats)).sum(-1) * math.log(2)  # type: ignore[union-attr]

    # out = 0 makes the kernel's own <dout, out> zero; the merged delta arrives as -grad_lse
    dq, dk, dv, _ = flex_attention_backward(
        q, k, v, q.new_zeros(*q.shape[:-1], v.shape[-1]), lse_log2, dout, grad_lse_log2,
        graphs["score_graph"]["graph"], graphs["joint_graph"]["graph"],
        (*block_mask, graphs["mask_graph"]["graph"]), scale, options, (), mask_buffers,
    )
    return dq, dk, dv


@functools.cache
def _score_graphs(device: torch.device, dtype: torch.dtype) -> tuple[GraphModule, GraphModule]:
    """The identity score_mod and its joint (gradient) graph, traced as FlexAttention's autograd traces
    them (``create_fw_bw_graph``), once per device and dtype."""
    from torch._higher_order_ops.flex_attention import create_fw_bw_graph
    from torch.nn.attention.flex_attention import _identity

    index = [torch.zeros((), dtype=torch.int, device=device) for _ in range(4)]
    score = torch.zeros((), dtype=dtype, device=device, requires_grad=True)
    _, joint = create_fw_bw_graph(_identity, (score, *index), ())
    return _traced(_identity, score, *index), joint


@functools.lru_cache(maxsize=64)
def _mask_graph(
    predicate: Callable[..., Tensor], device: torch.device, buffers: tuple[tuple[tuple[int, ...], torch.dtype], ...]
) -> GraphModule:
    """``predicate(b, h, q_idx, kv_idx, *buffers)`` traced once per device and buffer shapes."""
    index = [torch.zeros((), dtype=torch.int, device=device) for _ in range(4)]
    return _traced(predicate, *index, *(torch.zeros(shape, dtype=dtype, device=device) for shape, dtype in buffers))


def _traced(fn: Callable[..., Tensor], *example: Tensor) -> GraphModule:
    """``fn`` as an FX graph, traced on fake tensors the way FlexAttention traces its subgraphs (tensor
    indexing becomes ``aten.index``)."""
    from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex
    from torch.fx.experimental.proxy_tensor import make_fx

    with TransformGetItemToIndex():
        return make_fx(fn, tracing_mode="fake")(*example)
