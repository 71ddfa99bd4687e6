"""The ``dflash`` objective: labels, weights, normalisation and the chunked LM-head loss of the
anchor-block rows a rank holds (objectives.md §5.6, §6).

For block ``n`` with anchor ``a_n`` and slot ``j``::

    y[n, j]     = x[a_n + j]                                            # same-position labels
    valid[n, j] = keep_n · [a_n + j < L] · [j >= 1] · λ[a_n + j] · [a_n + j in a_n's segment]
    ω[n, j]     = valid[n, j] · exp(−(j − 1)/γ)                         (γ None -> 1)

(The segment factor stops supervision at packed-document boundaries, objectives.md §5.3.) The
per-token loss ``ℓ`` is the hard CE against ``y`` (optionally the ``tv``/``lambda`` mix), or the
forward ``KL(teacher ‖ draft)`` with teacher logits ``lm_head(last_hidden[a_n + j − 1])``.

**Normalisation** (Turbo-dLLM rule, global across ranks)::

    L_DF = mean over samples s of  Σ_{rows of s} w·ℓ / (den_s + 1e−5)

``w = ω`` with ``den_s`` the **global** number of supervised slots of sample ``s`` (every rank
knows all anchors of a sample, so this needs no communication), or D-PACE weights with ``den_s``
their global sum (an all-reduce without gradient over the ranks that split the anchors). A rank
returns its own rows' share; shares sum to ``L_DF`` over the owners.

**Gradient of non-CE losses.** ``tv``/``lambda`` run the chunked CE with per-row coefficients
``w·dℓ/dCE`` (``dTV/dCE = p``) and add ``(value − surrogate).detach()``: the value is exact and the
gradient is exactly ``Σ w·∇ℓ`` without materialising ``[R, V]`` logits.

**Selector** (DFlash2)::

    L_sel = mean_s Σ ω·CE_K(S(y_{j−1}, c_j), idx(y_j in c_j)) / (den_sel_s + 1e−5)

over supervised slots whose gold token is among the top-K candidates (others excluded and counted
for ``candidate_recall``); ``den_sel_s`` is the global covered weight sum. ``L = L_DF + α·L_sel``.

**Metrics** (sums, reduced by the caller): supervised slots, correct argmax slots, live blocks and
``Σ τ̂_n`` with ``τ̂_n = 1 + Σ_{j≥1} valid_j · Π_{i≤j} match_i`` (unsupervised slots count as
matches inside the product, then are zeroed), selector-covered slots.

Shape legend: ``L`` sequence length, ``n`` anchors of a packet, ``B`` block size, ``R`` rows,
``D`` hidden, ``V`` vocabulary, ``K`` candidates.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from csbp.dflash.anchors import segment_starts
from csbp.dflash.chunked_kl import chunked_forward_kl, scan_rows
from csbp.dflash.config import DFlashObjectiveConfig
from csbp.dflash.dflash2 import CandidateSelector, dpace_weights
from csbp.dflash.layouts import AnchorPacket
from csbp.objectives.chunked_ce import chunked_weighted_ce

DENOMINATOR_EPS = 1e-5
Reduce = Callable[[Tensor], Tensor]
METRIC_NAMES = ("supervised", "correct", "live_blocks", "tau_sum", "covered", "lk_ce", "lk_tv", "prob_sum", "prob_count")
"""Detached sums of a rank: the metrics' counts, and the ``lambda`` LK loss's parts (``lk_ce``: the
loss share with ``c = 1``, ``lk_tv``: with ``c = 0``; ``prob_sum``/``prob_count``: its acceptance),
from which validation recomputes the mix with the acceptance of the whole pass."""


@dataclass(frozen=True)
class BlockTargets:
    """Per-row targets of whole anchor blocks (rows ``n·B + j``), concatenated over samples.

    Attributes:
        labels: ``[R]`` ``x[a+j]`` (0 where ``a+j >= L``).
        valid: ``[R]`` supervised rows (module docstring).
        slot: ``[R]`` ``j``.
        sample: ``[R]`` sample index in the micro-batch.
        prev_tokens: ``[R]`` ``x[a+j−1]`` (the selector's teacher-forced predecessor).
        live: ``[R]`` False for the rows of dead anchors.
        teacher: ``[R, D]`` target last hidden state at ``a+j−1`` (KL), or None.
    """

    labels: Tensor
    valid: Tensor
    slot: Tensor
    sample: Tensor
    prev_tokens: Tensor
    live: Tensor
    teacher: Tensor | None

    @staticmethod
    def cat(parts: list[BlockTargets]) -> BlockTargets:
        """The parts' rows in order; a teacher on every part or on none (a KL over only some rows'
        teachers would be a silently different loss)."""
        teachers = [p.teacher for p in parts if p.teacher is not None]
        if teachers and len(teachers) != len(parts):
            raise ValueError(
                f"BlockTargets.cat: {len(teachers)} of {len(parts)} parts carry a teacher; give every part one or none"
            )
        teacher = torch.cat(teachers) if teachers else None
        fields = ("labels", "valid", "slot", "sample", "prev_tokens", "live")
        return BlockTargets(*(torch.cat([getattr(p, f) for p in parts]) for f in fields), teacher=teacher)


def block_targets(
    input_ids_L: Tensor,
    loss_mask_L: Tensor,
    doc_ids_L: Tensor,
    packet: AnchorPacket,
    block_size: int,
    *,
    sample: int,
    last_hidden_LD: Tensor | None = None,
    last_hidden_positions: Tensor | None = None,
) -> BlockTargets:
    """Labels and supervision of the packet's blocks in one sample (module docstring).
    ``last_hidden_positions``: the sorted positions of ``last_hidden_LD``'s rows when it holds only
    some rows (``csbp.dflash.teacher_rows``: every supervised row's predecessor among them); None
    when row ``p`` is position ``p``. Unsupervised rows then read an arbitrary held row (or zeros)."""
    seq_len = input_ids_L.shape[0]
    slot = torch.arange(block_size).repeat(len(packet))
    anchor = packet.anchors.repeat_interleave(block_size)
    live = packet.keep.repeat_interleave(block_size)
    position = anchor + slot
    inside = position < seq_len
    safe = position.clamp(max=seq_len - 1)
    previous = (position - 1).clamp(min=0, max=seq_len - 1)
    segments = segment_starts(doc_ids_L.cpu())
    same_segment = segments[safe] == segments[anchor]
    valid = live & inside & (slot >= 1) & loss_mask_L.cpu().bool()[safe] & same_segment
    ids = input_ids_L.cpu()
    teacher = None
    if last_hidden_LD is not None and last_hidden_positions is None:
        teacher = last_hidden_LD[previous.to(last_hidden_LD.device)]
    elif last_hidden_LD is not None and last_hidden_positions is not None:
        if last_hidden_LD.shape[0] == 0:
            teacher = last_hidden_LD.new_zeros((previous.shape[0], last_hidden_LD.shape[-1]))
        else:
            held = last_hidden_positions.cpu()
            row = torch.searchsorted(held, previous).clamp(max=held.shape[0] - 1)
            teacher = last_hidden_LD[row.to(last_hidden_LD.device)]
    return BlockTargets(
        labels=torch.where(inside, ids[safe], 0),
        valid=valid,
        slot=slot,
        sample=torch.full_like(slot, sample),
        prev_tokens=ids[previous],
        live=live,
        teacher=teacher,
    )


def slot_decay(slot_R: Tensor, gamma: float | None, dtype: torch.dtype) -> Tensor:
    """``exp(−(j−1)/γ)`` per row (1 without decay; slot 0 gets ``exp(1/γ)`` but is never valid)."""
    if gamma is None:
        return torch.ones(slot_R.shape, dtype=dtype)
    return torch.exp(-(slot_R.to(dtype) - 1.0) / gamma)


@dataclass(frozen=True)
class RankLossOutput:
    """This rank's share of the objective (before ``loss_scale``).

    Attributes:
        loss: differentiable ``L_DF share + selector_scale · L_sel share``.
        main: detached ``L_DF`` share.
        selector: detached ``L_sel`` share (0 without a selector).
        metrics: detached sums named in ``METRIC_NAMES`` (float64 scalars).
    """

    loss: Tensor
    main: Tensor
    selector: Tensor
    metrics: dict[str, Tensor]


def rank_dflash_loss(
    hidden_RD: Tensor,
    lm_head_weight: Tensor,
    targets: BlockTargets,
    objective: DFlashObjectiveConfig,
    *,
    block_size: int,
    sample_counts: Tensor,
    reduce: Reduce,
    reduce_batch: Reduce | None = None,
    selector: CandidateSelector | None = None,
    selector_scale: float = 0.0,
) -> RankLossOutput:
    """The loss of this rank's block rows (module docstring).

    ``sample_counts [num_samples]`` are the global supervised-slot counts per sample; ``reduce``
    sums a tensor over the ranks that split the anchors of these samples (identity when one rank
    holds every anchor); ``reduce_batch`` sums it over every anchor of the micro-batch, every
    data-parallel replica included (default ``reduce``: one replica), for the ``lambda`` LK loss's
    acceptance, a statistic of the whole batch.
    """
    num_samples = int(sample_counts.shape[0])
    accum = torch.float64 if hidden_RD.dtype == torch.float64 else torch.float32
    scored = torch.nonzero(targets.valid).flatten()
    hidden_sD = hidden_RD[scored.to(hidden_RD.device)]
    labels_s = targets.labels[scored].to(hidden_RD.device)
    sample_s = targets.sample[scored]
    top_k = selector.top_k if selector is not None else 0
    log_prob_s, argmax_s, top_sK = scan_rows(
        hidden_sD.detach(), lm_head_weight, labels_s, chunk_rows=objective.ce_chunk_rows, top_k=top_k
    )
    log_prob_s, argmax_s = log_prob_s.cpu(), argmax_s.cpu()
    decay_s = slot_decay(targets.slot[scored], objective.gamma, accum)

    if objective.weighting == "decay":
        weight_s = decay_s
        denominator = sample_counts.to(accum)
    else:
        prob_R = torch.ones(targets.valid.shape, dtype=accum)
        prob_R[scored] = log_prob_s.exp()
        weight_R = dpace_weights(
            prob_R.view(-1, block_size),
            targets.valid.view(-1, block_size),
            alpha=objective.dpace_alpha,
            kind=objective.weighting,
        ).flatten()
        weight_s = weight_R[scored]
        denominator = reduce(_per_sample_sum(weight_s, sample_s, num_samples))
    coef_s = weight_s / (num_samples * (denominator[sample_s] + DENOMINATOR_EPS))
    main = _main_loss(
        hidden_sD, lm_head_weight, labels_s, coef_s, log_prob_s, targets, scored, objective, reduce_batch or reduce
    )

    selector_loss = torch.zeros((), dtype=accum, device=hidden_RD.device)
    covered_s = torch.zeros(scored.shape, dtype=torch.bool)
    if selector is not None:
        assert top_sK is not None
        covered_s = (top_sK.cpu() == labels_s.cpu()[:, None]).any(dim=1)
        covered_weight = reduce(_per_sample_sum(decay_s * covered_s, sample_s, num_samples))
        sel_coef_s = decay_s / (num_samples * (covered_weight[sample_s] + DENOMINATOR_EPS))
        selector_loss = _selector_loss(
            selector,
            hidden_sD,
            lm_head_weight,
            labels_s,
            top_sK,
            targets.prev_tokens[scored],
            covered_s,
            sel_coef_s,
            stop_gradient=objective.selector_stop_gradient,
        )
    loss = main + selector_scale * selector_loss
    metrics = _metrics(targets, scored, argmax_s == labels_s.cpu(), covered_s, block_size)
    prob_s = log_prob_s.to(torch.float64).exp()
    coef64_s = coef_s.to(torch.float64)
    metrics.update(
        lk_ce=(coef64_s * -log_prob_s.to(torch.float64)).sum(),
        lk_tv=(coef64_s * (1.0 - prob_s)).sum(),
        prob_sum=prob_s.sum(),
        prob_count=torch.tensor(float(prob_s.numel()), dtype=torch.float64),
    )
    return RankLossOutput(loss, main.detach(), selector_loss.detach(), metrics)


def _per_sample_sum(values_s: Tensor, sample_s: Tensor, num_samples: int) -> Tensor:
    return torch.zeros(num_samples, dtype=values_s.dtype).index_add_(0, sample_s, values_s)


def _main_loss(
    hidden_sD: Tensor,
    weight_VD: Tensor,
    labels_s: Tensor,
    coef_s: Tensor,
    log_prob_s: Tensor,
    targets: BlockTargets,
    scored: Tensor,
    objective: DFlashObjectiveConfig,
    reduce_batch: Reduce,
) -> Tensor:
    device, chunk = hidden_sD.device, objective.ce_chunk_rows
    if objective.loss == "kl":
        assert targets.teacher is not None, "loss='kl' needs the target's last hidden state"
        teacher_sD = targets.teacher[scored.to(targets.teacher.device)].to(device)
        return chunked_forward_kl(hidden_sD, teacher_sD, weight_VD, coef_s.to(device), chunk_rows=chunk)
    if objective.lk_loss_type == "ce":
        return chunked_weighted_ce(hidden_sD, weight_VD, labels_s, coef_s.to(device), chunk_rows=chunk)
    prob_s = log_prob_s.exp()
    ce_coef = 0.0
    if objective.lk_loss_type == "lambda":
        # the batch's acceptance: every replica's anchors (was: this replica's, so dp > 1 gave another loss)
        stats = reduce_batch(torch.stack([prob_s.sum(), torch.tensor(float(prob_s.numel()), dtype=prob_s.dtype)]))
        ce_coef = lambda_ce_coef(objective, float(stats[0]), float(stats[1]))
    value = (coef_s * (ce_coef * -log_prob_s + (1.0 - ce_coef) * (1.0 - prob_s))).sum()
    grad_coef_s = coef_s * (ce_coef + (1.0 - ce_coef) * prob_s)
    surrogate = chunked_weighted_ce(hidden_sD, weight_VD, labels_s, grad_coef_s.to(device), chunk_rows=chunk)
    return surrogate + (value.to(surrogate) - surrogate).detach()


def lambda_ce_coef(objective: DFlashObjectiveConfig, prob_sum: float, prob_count: float) -> float:
    """The ``lambda`` LK loss's CE weight ``c = kl_scale·exp(−kl_decay·acceptance)``, the acceptance
    the mean target-token probability ``prob_sum / prob_count`` (0 without a scored slot)."""
    acceptance = prob_sum / prob_count if prob_count > 0 else 0.0
    return objective.kl_scale * math.exp(-objective.kl_decay * acceptance)


def _selector_loss(
    selector: CandidateSelector,
    hidden_sD: Tensor,
    weight_VD: Tensor,
    labels_s: Tensor,
    candidates_sK: Tensor,
    prev_s: Tensor,
    covered_s: Tensor,
    coef_s: Tensor,
    *,
    stop_gradient: bool,
) -> Tensor:
    device = hidden_sD.device
    rows = torch.nonzero(covered_s).flatten().to(device)
    hidden_cD = hidden_sD[rows]
    if stop_gradient:
        hidden_cD = hidden_cD.detach()
    candidates_cK = candidates_sK[rows]
    unary_cK = torch.einsum("ckd,cd->ck", weight_VD[candidates_cK], hidden_cD)
    scores_cK = selector.pair_scores(hidden_cD, unary_cK, prev_s[rows.cpu()].to(device), candidates_cK)
    gold_c = (candidates_cK == labels_s[rows][:, None]).long().argmax(dim=1)
    ce_c = torch.logsumexp(scores_cK, dim=1) - scores_cK.gather(1, gold_c[:, None]).squeeze(1)
    return (coef_s[rows.cpu()].to(ce_c) * ce_c).sum()


@torch.no_grad()
def _metrics(
    targets: BlockTargets, scored: Tensor, correct_s: Tensor, covered_s: Tensor, block_size: int
) -> dict[str, Tensor]:
    match_R = torch.ones(targets.valid.shape, dtype=torch.bool)
    match_R[scored] = correct_s
    valid_nB = targets.valid.view(-1, block_size)
    prefix_nB = torch.cumprod(match_R.view(-1, block_size)[:, 1:].long(), dim=1)  # slots 1 … B−1
    live_n = targets.live.view(-1, block_size)[:, 0]
    tau_n = 1 + (prefix_nB * valid_nB[:, 1:].long()).sum(dim=1)
    return {
        "supervised": torch.tensor(float(scored.numel()), dtype=torch.float64),
        "correct": correct_s.sum().to(torch.float64),
        "live_blocks": live_n.sum().to(torch.float64),
        "tau_sum": (tau_n * live_n).sum().to(torch.float64),
        "covered": covered_s.sum().to(torch.float64),
    }


def supervised_slot_counts(parts: list[BlockTargets], num_samples: int) -> Tensor:
    """``[num_samples]`` supervised slots per sample over *all* anchors (the global denominators)."""
    counts = torch.zeros(num_samples, dtype=torch.float64)
    for part in parts:
        counts.index_add_(0, part.sample, part.valid.to(torch.float64))
    return counts
