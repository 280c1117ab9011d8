"""Rollout correction: the sampler's own log-probs as the behaviour policy μ, a truncated importance
weight on each token's policy-gradient term, and optional rejection of tokens and sequences.

The samples come from the dense sampler (μ), while the loss's ratio is against π_old, the trainer's
own pass (through the compressed pipeline). The update's expectation is under μ, so each token's
term is reweighted by how much more (or less) likely π_old found it, per response token t:

    log r_t  = clamp(log π_old − log μ, −20, 20)             (exp(±20) stays finite in fp32)
    w_t      = min(e^{log r_t}, C)                           (truncated IS, C = rollout_is_threshold)
    keep_t   = [lo ≤ e^{log r_t} ≤ hi]                       (token rejection, rollout_rs_token = [lo, hi])
    keep_i   = [lo_g ≤ exp(mean_t log r_t) ≤ hi_g]           (sequence guard on the geometric-mean ratio,
                                                              rollout_rs_geometric = [lo_g, hi_g])
    pg_t    ← w_t · keep_t · keep_i · pg_t                   (grpo/loss.py; w, keep carry no gradient)

The formulas are verl's `algorithm.rollout_correction` (rollout_corr_helper.py): token-level
`rollout_is` with `rollout_is_threshold` C; rejection `rollout_rs=token_k1` and `seq_mean_k1`,
whose bounds verl states on μ/π_old (its k1 = −log r): our [lo, hi] on π_old/μ is its [1/hi, 1/lo].
Plain sequence-level IS (Π_t r_t) is not offered: on long responses a small per-token bias
compounds to a weight near 0 or C.

One deviation from verl, on purpose: a rejected token's policy-gradient term is 0 but it stays in
the token mean's count (the mini-batch's response tokens, as for left-out zero-advantage sequences)
and keeps its KL term, so rejection never enlarges the other tokens' step. verl's rollout_rs removes
rejected tokens from the response mask, hence from the denominator and the KL term too (its IcePop
mode, a "lo_hi" rollout_is_threshold, zeroes the weight and keeps the count, as here). With μ = π_old every weight is 1 and
nothing is rejected at bounds around 1.
"""
import math
from dataclasses import dataclass

import torch

LOG_RATIO_CLAMP = 20.0     # verl's SAFETY_BOUND


@dataclass(frozen=True)
class Correction:
    is_threshold: float = 2.0                          # C
    token_bounds: tuple[float, float] | None = None    # [lo, hi] on π_old/μ per token
    geometric_bounds: tuple[float, float] | None = None  # [lo, hi] on each sequence's geometric-mean ratio

    @classmethod
    def from_config(cls, rc) -> "Correction | None":
        """From `grpo.rollout_correction`; None when it is off."""
        if not rc.enabled:
            return None
        return cls(rc.rollout_is_threshold, tuple(rc.rollout_rs_token) or None, tuple(rc.rollout_rs_geometric) or None)


def log_ratio(old_BT: torch.Tensor, behav_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """(B, T) clamp(log π_old − log μ, ±20) on the response (`mask_BT` True), 0 elsewhere."""
    d = torch.where(mask_BT, old_BT - behav_BT, torch.zeros_like(old_BT))
    return d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def kept(lr_BT: torch.Tensor, mask_BT: torch.Tensor, c: Correction) -> torch.Tensor:
    """(B, T) bool: the response tokens neither rejected on their own ratio nor with their sequence."""
    keep = mask_BT.clone()
    if c.token_bounds is not None:
        lo, hi = c.token_bounds
        keep &= (lr_BT >= math.log(lo)) & (lr_BT <= math.log(hi))
    if c.geometric_bounds is not None:
        lo, hi = c.geometric_bounds
        n_B = mask_BT.sum(1).clamp(min=1)
        mean_B = lr_BT.sum(1) / n_B                    # lr is 0 off the response
        keep &= ((mean_B >= math.log(lo)) & (mean_B <= math.log(hi)))[:, None]
    return keep


def correction_weights(old_BT: torch.Tensor, behav_BT: torch.Tensor, mask_BT: torch.Tensor,
                       c: Correction) -> torch.Tensor:
    """(B, T) w_t · keep_t · keep_i, detached; 0 off the response. old/behav: (B, T) log-probs of the
    sampled targets under π_old and μ; mask_BT: (B, T) bool, the response tokens."""
    with torch.no_grad():
        lr = log_ratio(old_BT, behav_BT, mask_BT)
        w = lr.exp().clamp(max=c.is_threshold)
        return torch.where(kept(lr, mask_BT, c), w, torch.zeros_like(w))


CORRECTION_SUMS = ["rollout_corr/rollout_is_mean", "rollout_corr/_is_sq", "rollout_corr/rollout_is_ratio_fraction_high",
                   "rollout_corr/rollout_rs_masked_fraction"]


def correction_sums(old_BT, behav_BT, weight_BT, c: Correction) -> dict[str, torch.Tensor]:
    """Weighted sums over response tokens (`weight_BT` > 0 there, summing to 1 over the batch once
    summed over ranks) of the truncated IS weight min(r, C) before rejection (verl's rollout_is_*), its
    square (for the effective sample size), the share of ratios above C, and the share rejected."""
    mask = weight_BT > 0
    lr = log_ratio(old_BT, behav_BT, mask)
    w = lr.exp().clamp(max=c.is_threshold)
    return {"rollout_corr/rollout_is_mean": (weight_BT * w).sum(), "rollout_corr/_is_sq": (weight_BT * w * w).sum(),
            "rollout_corr/rollout_is_ratio_fraction_high": (weight_BT * (lr > math.log(c.is_threshold)).float()).sum(),
            "rollout_corr/rollout_rs_masked_fraction": (weight_BT * (mask & ~kept(lr, mask, c)).float()).sum()}


def largest_weight(old_BT, behav_BT, mask_BT, c: Correction) -> float:
    """max_t min(r_t, C) over the response tokens (verl's rollout_is_max); 0 with none."""
    w = log_ratio(old_BT, behav_BT, mask_BT).exp().clamp(max=c.is_threshold)
    return float(torch.where(mask_BT, w, torch.zeros_like(w)).max()) if mask_BT.any() else 0.0


def effective_sample_size(mean: float, mean_sq: float) -> float:
    """verl's rollout_is_eff_sample_size, 1 / E[(w / E[w])²] = E[w]² / E[w²]: 1 when every weight is
    equal, towards 0 as a few tokens carry the batch."""
    return mean * mean / mean_sq if mean_sq > 0 else 1.0
