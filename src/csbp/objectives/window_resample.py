"""BD3-LM's ``resample``: keep every block's realised masked fraction inside the noise window.

Clipping the noise level to ``[t_min, t_max]`` bounds each block's masking *probability*; the
fraction of its tokens actually masked still spreads around it (with ``B = 16`` and ``t = 0.3``, a
block is fully clean 0.3% of the time and half or more masked 7%). bd3lms' ``training.resample``
redraws a block's masks, with the same ``t``, until that fraction lies in the window, which is what
makes the clipped schedule's loss variance as low as the window promises.

csbp draws the same distribution in one pass instead of a loop: conditioned on its count ``k``, a
block's masked set is a uniform subset of its supervised positions, and redrawing until ``k`` is
in range is rejection sampling of ``Binomial(n, t)`` restricted to the window. So a block already in
range keeps its draw, and a block out of range takes a count from the restricted binomial (one
uniform, inverse CDF) and masks the positions with its ``k`` smallest uniforms. The result has the
law of bd3lms' loop, its cost is bounded, and it uses a fixed number of draws, so it is as
deterministic as the rest of the corruption.

Conventions (bd3lms' where it has one):

* the fraction counts a block's supervised tokens only (``loss_mask``; all ``B`` without one), as
  only those are ever masked; a block with none is left alone;
* a lower end at or below :data:`UNBOUNDED_LOW` (bd3lms' 0.001, csbp's default ``t_min``) and an
  upper end of 1 bound nothing, as in bd3lms' "if a bound is epsilon, don't resample";
* a partly supervised block whose ``n`` admits no count in the window (one supervised token and a
  window ``[0.3, 0.8]``) keeps its independent draw: bd3lms' loop would never end on it. A fully
  supervised block always admits one: :func:`window_count_problem` refuses a window that does not.
"""

from __future__ import annotations

import torch
from torch import Tensor

UNBOUNDED_LOW = 1e-3
"""A window's lower end at or below this bounds nothing (bd3lms' unclipped ``sampling_eps_min``)."""


def _allowed(count: Tensor, supervised: Tensor, t_min: float, t_max: float) -> Tensor:
    """Whether ``count / supervised`` lies in the window (float64, as bd3lms compares fractions)."""
    fraction = count.to(torch.float64) / supervised.clamp(min=1).to(torch.float64)
    ok = torch.ones_like(fraction, dtype=torch.bool)
    if t_min > UNBOUNDED_LOW:
        ok &= fraction >= t_min
    if t_max < 1.0:
        ok &= fraction <= t_max
    return ok & (count <= supervised)


def window_count_problem(block_size: int, t_min: float, t_max: float) -> str | None:
    """Why a fully supervised block of ``block_size`` tokens can never be in ``[t_min, t_max]``, or None."""
    counts = torch.arange(block_size + 1)
    if bool(_allowed(counts, torch.full_like(counts, block_size), t_min, t_max).any()):
        return None
    return (
        f"no count of masked tokens out of a block of {block_size} lies in the noise window "
        f"[{t_min:g}, {t_max:g}] (fractions step by 1/{block_size})"
    )


def resample_into_window(
    masked_SL: Tensor,
    uniforms_SL: Tensor,
    loss_mask_SL: Tensor,
    noise_levels_SN: Tensor,
    *,
    block_size: int,
    t_min: float,
    t_max: float,
    generator: torch.Generator,
) -> Tensor:
    """``masked_SL & loss_mask_SL`` with every out-of-window block redrawn from the conditioned law.

    ``masked_SL`` must be ``uniforms_SL <= t`` of each token's block (the independent draw);
    ``noise_levels_SN`` is each (sample, block)'s ``t``. Draws one float64 uniform per (sample,
    block) from ``generator`` whatever the data, so later draws do not depend on how many moved.
    """
    num_samples, seq_len = masked_SL.shape
    num_blocks = seq_len // block_size
    choice_SN = torch.rand(num_samples, num_blocks, generator=generator, dtype=torch.float64)
    supervised_SNB = loss_mask_SL.reshape(num_samples, num_blocks, block_size)
    masked_SNB = masked_SL.reshape(num_samples, num_blocks, block_size) & supervised_SNB
    supervised_SN = supervised_SNB.sum(-1)
    count_SN = masked_SNB.sum(-1)

    counts_C = torch.arange(block_size + 1)
    allowed_SNC = _allowed(counts_C, supervised_SN[..., None], t_min, t_max)
    redraw_SN = (supervised_SN > 0) & ~_allowed(count_SN, supervised_SN, t_min, t_max) & allowed_SNC.any(-1)
    if not bool(redraw_SN.any()):
        return masked_SNB.reshape(num_samples, seq_len)

    # log C(n, c) t^c (1 - t)^(n - c) over the allowed counts, normalised: the restricted binomial.
    n_SN1 = supervised_SN[..., None].to(torch.float64)
    c_C = counts_C.to(torch.float64)
    level_SN1 = noise_levels_SN.to(torch.float64)[..., None]
    log_pmf_SNC = (
        torch.lgamma(n_SN1 + 1) - torch.lgamma(c_C + 1) - torch.lgamma((n_SN1 - c_C).clamp(min=0) + 1)
        + torch.xlogy(c_C, level_SN1) + torch.xlogy(n_SN1 - c_C, 1.0 - level_SN1)
    )
    log_pmf_SNC = log_pmf_SNC.masked_fill(~allowed_SNC, float("-inf"))
    cdf_SNC = torch.softmax(log_pmf_SNC, dim=-1).cumsum(-1)
    # The first allowed count whose CDF passes the uniform; rounding can leave the last CDF under it.
    passed_SNC = (cdf_SNC > choice_SN[..., None]) & allowed_SNC
    last_allowed_SN = block_size - allowed_SNC.flip(-1).to(torch.int8).argmax(-1)
    new_count_SN = torch.where(passed_SNC.any(-1), passed_SNC.to(torch.int8).argmax(-1), last_allowed_SN)

    # The k smallest uniforms among the supervised positions: a uniform k-subset, given k.
    ranked_SNB = uniforms_SL.reshape(num_samples, num_blocks, block_size).masked_fill(~supervised_SNB, 2.0)
    rank_SNB = ranked_SNB.argsort(dim=-1, stable=True).argsort(dim=-1, stable=True)
    redrawn_SNB = (rank_SNB < new_count_SN[..., None]) & supervised_SNB
    return torch.where(redraw_SN[..., None], redrawn_SNB, masked_SNB).reshape(num_samples, seq_len)
