"""DFlash2 additions (objectives.md §6): the dynamic block convolution, the low-rank candidate
selector, D-PACE confidence weights and the selector warm-up schedule.

**Dynamic depthwise convolution** (``DynamicBlockConv``), one per sub-layer (attention, MLP) of
every draft layer, acting on the block stream only. For a sub-layer ``f`` with normalised input
``u``::

    δ[p]        = W_kp · u[p]                       # 2 sides × T taps × G groups; W_kp zero-init
    κ_side[p]   = base_side + δ_side[p]             # base 2 × T × H, identity init (tap 0 = 1)
    conv(z,κ)[p] = Σ_{t<T} κ[p,t] ⊙ z[p−t]          # p−t inside the same block, else 0
    out         = conv( f( conv(u, κ_in) ), κ_out )

``δ`` is per group of ``conv_group_size`` channels and broadcast over its channels. The identity
initialisation makes a fresh DFlash2 layer compute exactly the DFlash layer.

**Candidate selector** (``CandidateSelector``): for hidden ``h_p`` with unary logits
``U_p = lm_head(h_p)`` and candidates ``c_p = topK(U_p)``::

    S_p(a, b) = U_p(b) + ⟨ A[a] ⊙ (W_h·h_p), Bk[b] ⟩        # A, Bk ∈ R^{V×r}, Bk zero-init

so a fresh selector ranks candidates exactly by the unary logits (plain DFlash). ``a`` is the
predecessor token (teacher-forced in training: the true previous token, the anchor for slot 1).

**D-PACE** (``dpace_weights``): detached weights from the draft probability of the label,
``s_j = α + (1−α)·q_j``, ``P_j = Π_{i≤j} s_i``, ``u_j = Σ_{m≥j} P_m·valid_m``; unsupervised slots
have ``s = 1`` (neutral in the product) and weight 0.

Shape legend: ``S`` samples, ``N`` block rows (whole blocks of ``B``), ``H`` hidden, ``T`` taps,
``G`` groups, ``R`` scored rows, ``K`` candidates, ``V`` vocabulary, ``r`` selector rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class DynamicBlockConv(nn.Module):
    """The input- and output-side kernels of one sub-layer (see the module docstring)."""

    def __init__(
        self,
        hidden_size: int,
        *,
        kernel_size: int,
        group_size: int,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if hidden_size % group_size != 0:
            raise ValueError(f"hidden_size={hidden_size} must be a multiple of conv group_size={group_size}")
        self.kernel_size, self.group_size = kernel_size, group_size
        self.num_groups = hidden_size // group_size
        self.base = nn.Parameter(torch.zeros(2, kernel_size, hidden_size, dtype=dtype, device=device))
        self.kernel_proj = nn.Linear(
            hidden_size, 2 * kernel_size * self.num_groups, bias=False, dtype=dtype, device=device
        )
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Identity: tap 0 of both sides is 1, every other tap and the dynamic projection 0."""
        if self.base.device.type == "meta":
            return
        self.base.zero_()
        self.base[:, 0] = 1.0
        self.kernel_proj.weight.zero_()

    def kernels(self, u_SNH: Tensor) -> tuple[Tensor, Tensor]:
        """``(κ_in, κ_out)``, each ``[S, N, T, H]``, from the normalised sub-layer input ``u``."""
        delta = self.kernel_proj(u_SNH).unflatten(-1, (2, self.kernel_size, self.num_groups))  # [S,N,2,T,G]
        delta = delta.repeat_interleave(self.group_size, dim=-1)  # [S, N, 2, T, H]
        kappa = self.base + delta
        return kappa[:, :, 0], kappa[:, :, 1]


def block_conv(z_SNH: Tensor, kappa_SNTH: Tensor, block_size: int) -> Tensor:
    """``out[p] = Σ_t κ[p,t] ⊙ z[p−t]`` where ``p−t`` must stay inside ``p``'s block of ``block_size``
    consecutive rows (rows are whole blocks)."""
    num_samples, num_rows, width = z_SNH.shape
    if num_rows % block_size != 0:
        raise ValueError(f"block_conv needs whole blocks: {num_rows} rows, block_size={block_size}")
    z_blocks = z_SNH.view(num_samples, num_rows // block_size, block_size, width)
    kappa_blocks = kappa_SNTH.view(num_samples, num_rows // block_size, block_size, -1, width)
    out = kappa_blocks[:, :, :, 0] * z_blocks
    for tap in range(1, min(kappa_SNTH.shape[2], block_size)):
        shifted = F.pad(
            z_blocks[:, :, : block_size - tap], (0, 0, tap, 0)
        )  # z[p - tap], zero at the block start
        out = out + kappa_blocks[:, :, :, tap] * shifted
    return out.view(num_samples, num_rows, width)


class CandidateSelector(nn.Module):
    """Low-rank pairwise re-scoring of the top-K unary candidates (see the module docstring).

    Parameters: ``pred_embed`` (``A [V, r]``), ``cand_embed`` (``Bk [V, r]``, zero-init) and
    ``hidden_proj`` (``W_h: H -> r``).
    """

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        *,
        rank: int,
        top_k: int,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.top_k = top_k
        self.pred_embed = nn.Parameter(torch.zeros(vocab_size, rank, dtype=dtype, device=device))
        self.cand_embed = nn.Parameter(torch.zeros(vocab_size, rank, dtype=dtype, device=device))
        self.hidden_proj = nn.Linear(hidden_size, rank, bias=False, dtype=dtype, device=device)

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator, *, std: float = 0.02) -> None:
        """``A`` and ``W_h`` from ``normal(0, std)`` (CPU ``generator``), ``Bk = 0``."""
        for param in (self.pred_embed, self.hidden_proj.weight):
            param.copy_(torch.empty(param.shape, dtype=torch.float32).normal_(0.0, std, generator=generator))
        self.cand_embed.zero_()

    def pair_scores(
        self, hidden_RH: Tensor, unary_RK: Tensor, prev_tokens_R: Tensor, candidates_RK: Tensor
    ) -> Tensor:
        """``S(a, c_k) = U(c_k) + ⟨A[a] ⊙ W_h·h, Bk[c_k]⟩`` for every candidate, ``[R, K]``."""
        gate_Rr = self.hidden_proj(hidden_RH) * self.pred_embed[prev_tokens_R]
        bilinear_RK = torch.einsum("rkc,rc->rk", self.cand_embed[candidates_RK], gate_Rr)
        return unary_RK + bilinear_RK

    @torch.no_grad()
    def greedy_decode(self, hidden_NH: Tensor, lm_head_weight: Tensor, anchor_token: int) -> Tensor:
        """Greedy walk through the ``K × K`` lattices of one block: slot ``j`` (rows ``1 … B−1`` of
        ``hidden``) picks the best candidate given the token chosen at slot ``j−1`` (the anchor for
        slot 1). Returns the ``B−1`` drafted tokens (int64)."""
        unary_NV = hidden_NH[1:] @ lm_head_weight.t()
        unary_NK, candidates_NK = unary_NV.topk(self.top_k, dim=-1)
        previous = torch.tensor(anchor_token, device=hidden_NH.device)
        drafted = []
        for slot in range(candidates_NK.shape[0]):
            scores = self.pair_scores(
                hidden_NH[slot + 1 : slot + 2],
                unary_NK[slot : slot + 1],
                previous.view(1),
                candidates_NK[slot : slot + 1],
            )
            previous = candidates_NK[slot, scores[0].argmax()]
            drafted.append(previous)
        return torch.stack(drafted) if drafted else candidates_NK.new_zeros(0)  # B = 1: nothing to draft


@torch.no_grad()
def dpace_weights(prob_label_NB: Tensor, valid_NB: Tensor, *, alpha: float, kind: str) -> Tensor:
    """Detached D-PACE weights ``[N, B]`` for blocks of ``B`` slots (objectives.md §6.3).

    ``prob_label`` is the draft probability of each slot's label, ``valid`` the supervised slots.
    ``kind``: ``dpace`` (``u_j``), ``dpace-cumulative-confidence-only`` (``P_j``) or
    ``dpace-continuation-value-only`` (``u_j / P_j``), each times ``valid_j``.
    """
    valid = valid_NB.to(prob_label_NB.dtype)
    step = torch.where(valid_NB, alpha + (1.0 - alpha) * prob_label_NB, torch.ones_like(prob_label_NB))
    cumulative = torch.cumprod(step, dim=-1)  # P_j
    continuation = torch.flip(torch.cumsum(torch.flip(cumulative * valid, [-1]), dim=-1), [-1])  # u_j
    if kind == "dpace":
        weights = continuation
    elif kind == "dpace-cumulative-confidence-only":
        weights = cumulative
    elif kind == "dpace-continuation-value-only":
        weights = torch.where(cumulative > 0, continuation / cumulative.clamp_min(1e-300), 0.0)
    else:
        raise ValueError(f"unknown D-PACE weighting kind {kind!r}")
    return weights * valid


def selector_loss_scale(progress: float, *, alpha: float, warmup_ratio: float, ramp_ratio: float) -> float:
    """``α`` of ``L_DF + α·L_sel`` at training ``progress`` in ``[0, 1]``: 0 during the warm-up,
    then a linear ramp over ``ramp_ratio`` to ``alpha``."""
    if progress < warmup_ratio:
        return 0.0
    if ramp_ratio <= 0.0:
        return alpha
    return alpha * min(1.0, (progress - warmup_ratio) / ramp_ratio)
