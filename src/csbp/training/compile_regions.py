"""Regional ``torch.compile`` of the layers (``train.compile: layers``), applied from outside the model.

A decoder (or drafter) layer is mostly row-local math around one attention call: RMSNorms computed in
float32, the q/k/v projections with the per-head q/k norms and RoPE, and the SwiGLU MLP. Run eagerly,
each elementwise step of those is its own kernel and its own pass through memory; on a GPU that is
where a step's time goes besides the matmuls and attention. ``layers`` compiles exactly those parts of
every layer, as torch's regional-compilation recipe does for repeated blocks:

* ``input_layernorm`` and ``post_attention_layernorm`` (each one fused kernel instead of ~7),
* ``mlp`` (``silu(gate) * up`` fused around the three matmuls),
* ``self_attn.project_query`` and ``self_attn.project_key_value`` (projection, q/k norm and RoPE).

Under ``dflash`` the trainer compiles the drafter's layers and its frozen target's (the online feature
pass runs them without gradients: graphs of their own). The attention itself is not compiled: it is the caller's ``AttentionFn`` (tiles, FlexAttention with its
own compiled kernels, cuDNN pieces, collectives of every transport), so no graph ever holds a collective
and no transport changes. The residual adds and ``o_proj`` stay eager.

Every layer has the same code and its parameters are graph inputs (dynamo inlines ``nn.Module``s), so
each region compiles once and serves all layers: one graph per region, per grad mode and autocast
state, and per input shape (the first shape compiles static; a second, such as a DFlash context's
length, compiles one dynamic-shape graph). Hitting dynamo's recompile limit raises instead of running
eagerly (``configure_recompile_limits``).

Exactness: inductor computes the same operations, but a fused kernel may round differently (reductions
in another order), so a compiled step equals an eager one to round-off, not bit for bit; the tests
check loss and every gradient against the eager model in float64. Activation checkpointing and FSDP2
wrap the layer from outside and are applied around the compiled regions unchanged.

Compilation needs a compiler on the machine: Triton on CUDA (and a C compiler for its launcher), a C++
compiler on the CPU. :func:`check_compile_runs_on` says in one line when one is missing, before any
weight is built.
"""

from __future__ import annotations

import functools
import shutil
from collections.abc import Callable, Iterable
from typing import Literal, get_args

import torch
from torch import nn

from csbp.attention.flex_backward import configure_recompile_limits
from csbp.models.decoder import Attention

CompileMode = Literal["none", "layers"]
COMPILE_MODES: tuple[str, ...] = get_args(CompileMode)

COMPILED_SUBMODULES = ("input_layernorm", "post_attention_layernorm", "mlp")
"""Submodules of a layer compiled whole (their ``forward``)."""

COMPILED_PROJECTIONS = ("project_query", "project_key_value")
"""Methods of a layer's ``self_attn`` compiled (projection, q/k norm, RoPE)."""

C_COMPILERS = ("cc", "gcc", "clang")


def check_compile_mode(mode: str, *, where: str = "train.compile") -> str:
    """``mode`` if it is a compile mode, else one clear ``ValueError``."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"{where}: {mode!r} is not one of {COMPILE_MODES}")
    return mode


def compiler_problem(device: torch.device | str) -> str | None:
    """Why ``torch.compile`` cannot build kernels for ``device`` on this machine (None when it can)."""
    kind = torch.device(device).type
    if kind == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            return "Triton is not installed (it comes with torch's CUDA wheels)"
        if not any(shutil.which(name) for name in C_COMPILERS):
            return "no C compiler (cc, gcc or clang) is on PATH; Triton builds its kernel launcher with one"
        return None
    if kind == "cpu":
        from torch._inductor.cpp_builder import get_cpp_compiler

        try:
            get_cpp_compiler()
        except Exception as error:  # noqa: BLE001 - inductor raises its own InvalidCxxCompiler
            first = (str(error).strip().splitlines() or [type(error).__name__])[0]
            return f"inductor finds no C++ compiler ({first})"
        return None
    return f"csbp compiles layers on cuda and cpu only, not {kind}"


def check_compile_runs_on(mode: str, device: torch.device | str, *, where: str = "train.compile") -> None:
    """One clear ``ValueError`` when ``mode`` compiles and ``device`` has no compiler for it."""
    if check_compile_mode(mode, where=where) == "none":
        return
    problem = compiler_problem(device)
    if problem is not None:
        raise ValueError(
            f"{where}={mode} cannot compile on {torch.device(device).type}: {problem} "
            f"(fix: install one, or set {where} to none)"
        )


@functools.cache
def _compiled(fn: Callable[..., object]) -> Callable[..., object]:
    """``fn`` compiled once for every layer that calls it (whole: ``fullgraph``)."""
    return torch.compile(fn, fullgraph=True)


def compile_layers(layers: Iterable[nn.Module], mode: str) -> int:
    """Compile the non-attention regions (module docstring) of every layer for ``mode``; return how
    many layers (``none``: nothing, 0).

    Each layer needs ``input_layernorm``, ``post_attention_layernorm``, ``mlp`` and a
    ``self_attn`` :class:`~csbp.models.decoder.Attention` (decoder and DFlash drafter layers do).
    Apply it before activation checkpointing or FSDP wraps the layers, or after: both wrap the layer
    module, and these regions live inside it."""
    if check_compile_mode(mode) == "none":
        return 0
    configure_recompile_limits()
    count = 0
    for layer in layers:
        attention = getattr(layer, "self_attn", None)
        if not isinstance(attention, Attention):
            raise TypeError(f"compile_layers: {type(layer).__name__} has no self_attn Attention to compile around")
        for name in COMPILED_SUBMODULES:
            getattr(layer, name).compile(fullgraph=True)
        for name in COMPILED_PROJECTIONS:
            # an instance attribute shadows the method: the module, its names and state dict are unchanged
            setattr(attention, name, functools.partial(_compiled(getattr(Attention, name)), attention))
        count += 1
    return count


def compiled_layer_count(layers: Iterable[nn.Module]) -> int:
    """How many of ``layers`` carry compiled regions (what a test or a summary can check)."""
    return sum(
        isinstance(getattr(getattr(layer, "self_attn", None), "project_query", None), functools.partial)
        and getattr(layer.mlp, "_compiled_call_impl", None) is not None
        for layer in layers
    )
