"""CUDA checks of the paths a single GPU can run since packed documents and ``csbp eval`` came in
(``make gpu-check`` runs ``pytest -m cuda``; every test is skipped without a CUDA device).

* ``csbp eval``'s scoring (the NELBO over noise draws and the exact left-to-right NLL) of a
  float64 model on CUDA equals the CPU report, with and without document masking (the document
  planner's masks and plans built on the GPU);
* a BD3 step with packed documents under the document-aware ``balanced`` schedule, and a DFlash
  drafter step with packed documents, on CUDA equal the CPU reference (tiles in float64, and the
  backend ``auto`` picks on CUDA, flex, in float32 and in float64, the dtype ``csbp verify`` runs);
* a BD3 step with ``train.compile: layers`` (inductor's Triton kernels for the layers' regions) on
  CUDA equals the CPU reference in float32;
* batched sampling (``generate_batch``, greedy and at a positive temperature with top-k / top-p) of a
  float64 model on CUDA gives the CPU's completions: the proposals run on the device from the same
  per-sequence uniforms;
* the attention of one layer (BD3 local transport, DFlash drafter attention), once its plan is
  built, runs forward and backward without a host synchronisation (``torch.cuda.set_sync_debug_mode``
  raises on one): a ``.item()``/``.tolist()`` or a shape that depends on device values would stall
  every layer.

The ring transports of these paths (context exchange, async all-to-all) need one GPU per ring
member: the ``verify`` stages run them on 2+ GPUs, ``tests/test_collective_discipline.py`` checks
NCCL's rules for them on the CPU. ``CSBP_CUDA_TESTS_DEVICE=cpu`` runs these bodies on the CPU.

The file name sorts after the other CUDA test files on purpose: pytest runs files in name order,
and a ``cuda-tests`` stage cut by its 220 s limit then loses these newer checks, not the older ones.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from csbp.engine.context import single_process_context
from csbp.engine.verify import TOLERANCES, VerifyCase, _forward_backward, reference
from csbp.topology import Topology
from test_kernel import bd3_rows, random_qkv

DEVICE = os.environ.get("CSBP_CUDA_TESTS_DEVICE", "cuda")
pytestmark = pytest.mark.cuda


def _device() -> torch.device:
    return torch.device("cuda", 0) if DEVICE == "cuda" else torch.device("cpu")


def _rel(value: torch.Tensor, ref: torch.Tensor) -> float:
    value, ref = value.detach().cpu().double(), ref.detach().cpu().double()
    return float((value - ref).abs().max() / ref.abs().max())


@contextmanager
def _no_host_sync() -> Iterator[None]:
    """Inside, a CUDA operation that synchronises with the host raises (nothing to check on the CPU)."""
    if _device().type != "cuda":
        yield
        return
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


# ----------------------------------------------------------------------------- csbp eval


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from test_training_run import make_artifact

    return make_artifact(tmp_path_factory.mktemp("data") / "art")


@pytest.mark.parametrize("document_mask", [False, True], ids=["plain", "documents"])
def test_csbp_eval_on_cuda_matches_the_cpu_report(artifact: Path, document_mask: bool) -> None:
    from csbp.data.artifact import open_artifact
    from csbp.engine.verify import tiny_model_config
    from csbp.evaluation import EvalSettings
    from csbp.evaluation.runner import EvalOptions, evaluate_model
    from csbp.models.decoder import Decoder

    data = open_artifact(artifact)
    split = data.split("val")
    settings = EvalSettings(objective="bd3", block_size=4, mask_token_id=data.mask_token_id,
                            document_mask=document_mask)
    options = EvalOptions(samples=2, micro_batch_size=2, max_batches=2, ce_chunk_rows=16)
    config = replace(tiny_model_config(), vocab_size=data.vocab_size)
    reports = [
        evaluate_model(Decoder(config, dtype=torch.float64, seed=0, device=device), split, settings, options,
                       progress=False)
        for device in (torch.device("cpu"), _device())
    ]
    cpu, gpu = reports
    assert (gpu.rows, gpu.nelbo_tokens, gpu.ltr_tokens) == (cpu.rows, cpu.nelbo_tokens, cpu.ltr_tokens) and gpu.rows > 0
    for key in ("nelbo", "nelbo_stderr", "ltr_nll"):
        assert getattr(gpu, key) == pytest.approx(getattr(cpu, key), rel=1e-9), key


# ----------------------------------------------------------------------------- packed documents


@pytest.mark.parametrize(
    ("backend", "dtype"), [("tiles", "float64"), ("auto", "float32"), ("auto", "float64")],
    ids=["tiles-float64", "flex-float32", "flex-float64"],  # flex-float64: what `csbp verify --device cuda` runs
)
def test_bd3_step_with_documents_and_the_balanced_schedule_on_cuda_matches_the_cpu_reference(
    backend: str, dtype: str
) -> None:
    case = VerifyCase(Topology(), doc_length=3, schedule="balanced", backend=backend, dtype=dtype, device=DEVICE)
    tolerance = TOLERANCES[getattr(torch, dtype)]
    loss_ref, grads_ref = reference(case)
    loss, grads = _forward_backward(case, single_process_context(_device()), num_replicas=1)
    assert loss == pytest.approx(loss_ref, rel=tolerance)
    for name, ref in grads_ref.items():
        assert _rel(grads[name], ref) <= tolerance, name


def test_dflash_step_with_documents_on_cuda_matches_the_cpu_reference() -> None:
    from csbp.dflash.rank_plan import build_dflash_rank_plan
    from csbp.dflash.step import DFlashStep
    from csbp.dflash.verify import DFlashVerifyCase, anchor_generator, build_models, make_batch
    from csbp.dflash.verify import reference as dflash_reference

    case = DFlashVerifyCase(doc_length=6)
    loss_ref, grads_ref = dflash_reference(case)
    ctx = single_process_context(_device())
    _, drafter = build_models(case, device=ctx.device)
    step = DFlashStep(drafter, case.objective, build_dflash_rank_plan(ctx, case.objective))
    out = step(make_batch(case.samples, case.seq_len, seed=case.seed, doc_length=case.doc_length),
               anchor_generator(case, 0))
    out.loss.backward()
    assert out.loss_value == pytest.approx(loss_ref, rel=1e-9)
    for name, param in drafter.named_parameters():
        assert _rel(param.grad, grads_ref[name]) <= 1e-9, name


# ----------------------------------------------------------------------------- no host sync per layer


@pytest.mark.parametrize("backend", ["tiles", "auto"])
def test_a_layers_local_attention_does_not_synchronise_with_the_host(backend: str) -> None:
    from csbp.attention.transports.local import LocalAttentionFn

    noisy = [4, 5, 6, 7, 12, 13, 14, 15]
    attn = LocalAttentionFn(bd3_rows(noisy, list(range(16)), 4), num_noisy=len(noisy), tile_rows=4, backend=backend)
    q, k, v = (t.to(_device(), torch.float32) for t in random_qkv(24, 24, dim=16, seed=4))

    def layer() -> torch.Tensor:
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        attn(*leaves, 0).square().sum().backward()
        return leaves[0].grad

    first = layer()  # builds the plan on this device (and compiles flex)
    with _no_host_sync():
        again = layer()
    torch.testing.assert_close(again, first, rtol=1e-5, atol=1e-6)  # CUDA's index_add_ may reorder sums


def test_a_layers_dflash_attention_does_not_synchronise_with_the_host() -> None:
    from csbp.dflash.attention import ShardedDraftAttention, build_draft_attention_plan
    from csbp.dflash.layouts import context_rows, draft_query_rows, full_packet
    from csbp.dflash.verify import DFlashVerifyCase, build_models

    case = DFlashVerifyCase()
    config = build_models(case)[1].config
    anchors = torch.tensor([3, 9, 17])
    variants, causal, layer_variant = draft_query_rows(config, full_packet(anchors, torch.zeros_like(anchors)),
                                                       context="strict")
    plan = build_draft_attention_plan(
        [v.to(_device()) for v in variants], causal, layer_variant,
        context_rows(torch.arange(case.seq_len)).to(_device()), block_size=config.block_size, comm=None,
    )
    attention = ShardedDraftAttention(plan)
    heads, kv_heads, d = config.num_heads, config.num_kv_heads, config.head_dim
    generator = torch.Generator().manual_seed(5)
    rows = len(variants[0].pos)

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(_device())

    inputs = [draw(1, heads, rows, d), draw(1, kv_heads, case.seq_len, d), draw(1, kv_heads, case.seq_len, d),
              draw(1, kv_heads, rows, d), draw(1, kv_heads, rows, d)]

    def layer() -> torch.Tensor:
        leaves = [t.clone().requires_grad_(True) for t in inputs]
        attention(*leaves, 0).square().sum().backward()
        return leaves[1].grad

    first = layer()
    with _no_host_sync():
        again = layer()
    torch.testing.assert_close(again, first, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- train.compile (last: the slowest)


def test_a_compiled_bd3_step_on_cuda_matches_the_cpu_reference() -> None:
    """``train.compile: layers`` on the device: inductor's kernels for each layer's norms, projections
    and MLP (Triton on CUDA), the attention as without it (flex there), against the float64 CPU
    reference at float32's tolerance. Last in the file: its compilation is the slowest body here."""
    from csbp.engine.verify import check_case

    case = VerifyCase(Topology(), doc_length=3, backend="auto", dtype="float32", device=DEVICE, compile=True)
    check_case(case)  # the compiler is there (Triton on CUDA)
    loss_ref, grads_ref = reference(case)
    loss, grads = _forward_backward(case, single_process_context(_device()), num_replicas=1)
    tolerance = TOLERANCES[torch.float32]
    assert loss == pytest.approx(loss_ref, rel=tolerance)
    for name, ref in grads_ref.items():
        assert _rel(grads[name], ref) <= tolerance, name


# ----------------------------------------------------------------------------- sampling


@pytest.mark.parametrize("options", [{}, {"temperature": 1.0, "top_k": 20}, {"temperature": 0.8, "top_p": 0.9}],
                         ids=["greedy", "top_k", "top_p"])
def test_batched_sampling_on_cuda_gives_the_cpus_completions(options: dict[str, float]) -> None:
    from csbp.generation import GenerationConfig, generate_batch
    from test_generation import BLOCK, MASK, tiny_model

    config = GenerationConfig(block_size=BLOCK, steps_per_block=3, max_new_tokens=13, **options)  # type: ignore[arg-type]
    prompts, seeds = [[1, 2, 3], [4, 5, 6, 7, 8], [1, 2, 3]], [0, 1, 2]
    on_cpu = generate_batch(tiny_model(seed=1), prompts, seeds=seeds, mask_token_id=MASK, eos_id=None, config=config)
    on_device = generate_batch(
        tiny_model(seed=1).to(_device()), prompts, seeds=seeds, mask_token_id=MASK, eos_id=None, config=config
    )
    assert [r.token_ids for r in on_device] == [r.token_ids for r in on_cpu]
    assert [r.unmask_steps for r in on_device] == [r.unmask_steps for r in on_cpu]
