"""Single-process oracle of the ``dflash`` objective, written directly from the formulas of
objectives.md §5.5-§5.6 and §6 with dense masks and full ``[N·B, V]`` logits (tests only).

It shares nothing with the training path but the drafter's layer math: the mask is built from the
index formulas (not from ``Rows``), attention is dense SDPA, weights, D-PACE products, the
``lambda`` mix, the selector and the metrics are explicit loops/tensors over full logits. Every
parallel layout must reproduce its loss and gradients.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from csbp.dflash.anchors import segment_starts
from csbp.dflash.attention import DenseDraftAttention
from csbp.dflash.config import DFlashObjectiveConfig
from csbp.dflash.drafter import DFlashDrafter
from csbp.dflash.features import TargetFeatures

EPS = 1e-5


def reference_mask(
    seq_len: int,
    anchors: Tensor,
    doc_start: Tensor,
    block_size: int,
    *,
    context: str = "strict",
    window: int | None = None,
    causal_in_block: bool = False,
) -> Tensor:
    """``[N·B, L + N·B]`` bool: objectives.md §5.5 ``allow_DF`` / ``allow_DF_SW`` (all blocks kept)."""
    num = anchors.shape[0]
    mask = torch.zeros(num * block_size, seq_len + num * block_size, dtype=torch.bool)
    for q in range(num * block_size):
        n, j = divmod(q, block_size)
        a = int(anchors[n])
        stop = a if context == "strict" else a + 1
        for k in range(seq_len):
            visible = int(doc_start[n]) <= k < stop
            if window is not None:
                visible = visible and k >= a + j - (window - 1)
            mask[q, k] = visible
        for jk in range(block_size):
            mask[q, seq_len + n * block_size + jk] = (not causal_in_block) or jk <= j
    return mask


@dataclass(frozen=True)
class ReferenceOutput:
    """``loss = main + selector_scale·selector``; metrics as in ``csbp.dflash.loss``."""

    loss: Tensor
    main: Tensor
    selector: Tensor
    metrics: dict[str, float]


def reference_dflash_loss(
    drafter: DFlashDrafter,
    input_ids: Tensor,
    loss_mask: Tensor,
    doc_ids: Tensor,
    anchors: list[Tensor],
    features: TargetFeatures,
    objective: DFlashObjectiveConfig,
    *,
    selector_scale: float = 0.0,
) -> ReferenceOutput:
    """The objective of a micro-batch ``[S, L]`` with the given sorted anchors per sample."""
    cfg = drafter.config
    block, seq_len, num_samples = cfg.block_size, input_ids.shape[1], input_ids.shape[0]
    weight_VD = drafter.lm_head_weight
    per_sample = []
    for s in range(num_samples):
        a = anchors[s]
        seg = segment_starts(doc_ids[s])
        masks = []
        for kind in cfg.layer_types or ():
            sliding = kind == "sliding_attention"
            masks.append(
                reference_mask(
                    seq_len,
                    a,
                    seg[a],
                    block,
                    context=objective.context,
                    window=cfg.sliding_window if sliding else None,
                    causal_in_block=sliding and cfg.sliding_window_causal,
                )
            )
        ids = torch.full((len(a), block), cfg.mask_token_id, dtype=torch.long)
        ids[:, 0] = input_ids[s, a]
        positions = (a[:, None] + torch.arange(block)).flatten()
        hidden = drafter(
            drafter.embed(ids.flatten()[None]),
            positions,
            features.features[s : s + 1],
            torch.arange(seq_len),
            DenseDraftAttention(masks),
        )[0]
        logits = hidden @ weight_VD.t()
        log_probs = torch.log_softmax(logits, dim=-1)
        labels = torch.zeros(len(a) * block, dtype=torch.long)
        valid = torch.zeros(len(a) * block, dtype=torch.bool)
        prev = torch.zeros(len(a) * block, dtype=torch.long)
        teacher_rows = torch.zeros(len(a) * block, dtype=torch.long)
        for n in range(len(a)):
            for j in range(block):
                p, r = int(a[n]) + j, n * block + j
                prev[r] = input_ids[s, min(p - 1, seq_len - 1)]
                teacher_rows[r] = min(p - 1, seq_len - 1)
                if p < seq_len:
                    labels[r] = input_ids[s, p]
                    valid[r] = j >= 1 and bool(loss_mask[s, p]) and int(seg[p]) == int(seg[int(a[n])])
        per_sample.append((hidden, logits, log_probs, labels, valid, prev, teacher_rows))

    all_prob = torch.cat(
        [lp.detach().gather(1, y[:, None]).squeeze(1)[v] for _, _, lp, y, v, _, _ in per_sample]
    ).exp()
    acceptance = float(all_prob.mean()) if all_prob.numel() else 0.0
    ce_coef = objective.kl_scale * math.exp(-objective.kl_decay * acceptance)

    main = selector = torch.zeros((), dtype=torch.float64)
    metrics = dict.fromkeys(("supervised", "correct", "live_blocks", "tau_sum", "covered"), 0.0)
    for s, (hidden, logits, log_probs, labels, valid, prev, teacher_rows) in enumerate(per_sample):
        slots = torch.arange(len(labels)) % block
        decay = torch.ones(len(labels), dtype=torch.float64)
        if objective.gamma is not None:
            decay = torch.exp(-(slots.double() - 1.0) / objective.gamma)
        log_p = log_probs.gather(1, labels[:, None]).squeeze(1)
        if objective.loss == "kl":
            assert features.last_hidden is not None
            teacher = torch.log_softmax(features.last_hidden[s][teacher_rows] @ weight_VD.t(), dim=-1)
            token_loss = (teacher.exp() * (teacher - log_probs)).sum(-1)
        elif objective.lk_loss_type == "ce":
            token_loss = -log_p
        else:
            c = 0.0 if objective.lk_loss_type == "tv" else ce_coef
            token_loss = c * -log_p + (1.0 - c) * (1.0 - log_p.exp())
        if objective.weighting == "decay":
            weights = decay * valid
            denominator = float(valid.sum())
        else:
            weights = _dpace_reference(log_p.detach().exp(), valid, block, objective)
            denominator = float(weights.sum())
        main = main + (weights * token_loss).sum() / (denominator + EPS) / num_samples

        correct = (logits.argmax(-1) == labels) & valid
        metrics["supervised"] += float(valid.sum())
        metrics["correct"] += float(correct.sum())
        for n in range(len(labels) // block):
            tau, run = 1, True
            for j in range(1, block):
                r = n * block + j
                run = run and (bool(correct[r]) or not bool(valid[r]))
                tau += int(run and bool(valid[r]))
            metrics["tau_sum"] += tau
            metrics["live_blocks"] += 1

        if drafter.selector is not None:
            sel = drafter.selector
            top = logits.detach().topk(sel.top_k, dim=-1).indices
            covered = (top == labels[:, None]).any(-1) & valid
            metrics["covered"] += float(covered.sum())
            h = hidden.detach() if objective.selector_stop_gradient else hidden
            unary = torch.stack([(h[r] @ weight_VD.t())[top[r]] for r in range(len(labels))])
            gate = sel.hidden_proj(h) * sel.pred_embed[prev]
            scores = unary + torch.stack([sel.cand_embed[top[r]] @ gate[r] for r in range(len(labels))])
            gold = (top == labels[:, None]).long().argmax(-1)
            ce = torch.logsumexp(scores, -1) - scores.gather(1, gold[:, None]).squeeze(1)
            sel_weights = decay * covered
            selector = selector + (sel_weights * ce).sum() / (float(sel_weights.sum()) + EPS) / num_samples
    return ReferenceOutput(main + selector_scale * selector, main.detach(), selector.detach(), metrics)


def _dpace_reference(prob: Tensor, valid: Tensor, block: int, objective: DFlashObjectiveConfig) -> Tensor:
    weights = torch.zeros(len(prob), dtype=torch.float64)
    alpha = objective.dpace_alpha
    for n in range(len(prob) // block):
        rows = range(n * block, (n + 1) * block)
        cumulative, running = [], 1.0
        for r in rows:
            running *= alpha + (1 - alpha) * float(prob[r]) if bool(valid[r]) else 1.0
            cumulative.append(running)
        for i, r in enumerate(rows):
            if not bool(valid[r]):
                continue
            cont = sum(cumulative[m] for m in range(i, block) if bool(valid[n * block + m]))
            if objective.weighting == "dpace":
                weights[r] = cont
            elif objective.weighting == "dpace-cumulative-confidence-only":
                weights[r] = cumulative[i]
            else:
                weights[r] = cont / cumulative[i]
    return weights
