"""The GRPO token loss: clipped ratio with dual-clip, k3 KL to the reference, global token-mean.

Per response token t of sequence i, with ρ = exp(logπ_θ − logπ_old) and advantage Â_i:

    pg_t  = max(−Â·ρ, −Â·clip(ρ, 1−ε_low, 1+ε_high))          (PPO clip)
    pg_t  = min(pg_t, −Â·c)                  if Â < 0           (dual-clip, c = clip_ratio_c > 1)
    kl_t  = exp(d) − d − 1,  d = logπ_ref − logπ_θ               (k3 estimator, ≥ 0, unbiased for KL(π_θ‖π_ref))
    ℓ_t   = κ_t·pg_t + β·kl_t        (κ_t = 1; with grpo.rollout_correction, the weight of rollout_correction.py)

The KL term exists only where it counts: not at all at β = 0, and on response tokens only (d is set
to 0 elsewhere before the exponential: off the response the reference holds zeros, not log-probs, and a
target's log-prob below about −88.7 would make e^d inf and 0·inf a NaN in the loss and its
gradient). d is clamped to [−20, 20] as verl's `low_var_kl` clamps it, so e^d stays finite on the
response too; where the clamp does not bind the numbers are the unclamped ones bit for bit. verl's
second clamp, of the estimate to ≤ 10, is not applied: it is not a guard against overflow but a
change of objective (measured on this project's recipes: tokens past 10 occur within 10 steps, and
clamping them moved prf95's codec-view KL from 0.52 to 0.20 at step 3 and dropped their gradient).

Aggregation is token-mean over the whole PPO mini-batch: L = Σ_t w_t·ℓ_t with w_t = 1/N_tokens on
response tokens (0 elsewhere), N_tokens counted over the mini-batch, not the micro-batch. The caller
folds N_tokens (and DeepSpeed's division by gradient-accumulation steps) into `weight_BT`, so the
sum over micro-batches is the same number however the batch is split or the model is staged.

All log-probabilities come through the same pipeline (and, with a codec, the same mask), so ρ = 1
and kl = 0 exactly at the first update of a step at step 0.
"""
from dataclasses import dataclass

import torch

from .rollout_correction import Correction, correction_weights


@dataclass(frozen=True)
class LossCoefs:
    clip_low: float = 0.2
    clip_high: float = 0.2
    clip_ratio_c: float = 3.0
    kl_coef: float = 0.001
    correction: Correction | None = None     # the rollout correction (rollout_correction.py); None: off

    @classmethod
    def from_config(cls, g) -> "LossCoefs":
        """From the `grpo.*` config section."""
        return cls(g.clip_low, g.clip_high, g.clip_ratio_c, g.kl_coef, Correction.from_config(g.rollout_correction))


KL_LOG_RATIO_CLAMP = 20.0     # verl's low_var_kl bound on d: e^20 ≈ 4.9e8, finite in fp32


def k3_kl(logp_BT: torch.Tensor, ref_logp_BT: torch.Tensor, mask_BT: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T) k3 estimate per token of KL(π_θ‖π_ref) at tokens sampled from π: e^d − d − 1,
    d = logπ_ref − logπ_θ clamped to ±20; 0 where `mask_BT` is False (d is masked before the
    exponential, so the reference's zeros off the response never make an inf)."""
    d = ref_logp_BT - logp_BT
    if mask_BT is not None:
        d = torch.where(mask_BT, d, torch.zeros_like(d))
    d = d.clamp(-KL_LOG_RATIO_CLAMP, KL_LOG_RATIO_CLAMP)
    return torch.exp(d) - d - 1.0


def grpo_token_loss(logp_BT, old_logp_BT, ref_logp_BT, adv_B, weight_BT, coefs: LossCoefs, behav_logp_BT=None):
    """→ (loss scalar = Σ w·ℓ, metric sums dict). Metric sums are w-weighted (divide by Σw for means).

    logp_BT: (B, T) log π_θ of the target tokens, with grad. old/ref: (B, T), no grad.
    adv_B: (B,) sequence advantages. weight_BT: (B, T) per-token weights, 0 off the response.
    behav_logp_BT: (B, T) the sampler's log-probs μ, read with `coefs.correction`: each token's
    policy-gradient term × its correction weight (rollout_correction.py).
    """
    adv_B1 = adv_B.unsqueeze(1)
    log_ratio = logp_BT - old_logp_BT
    ratio = torch.exp(log_ratio)
    pg_unclipped = -adv_B1 * ratio
    pg_clipped = -adv_B1 * torch.clamp(ratio, 1.0 - coefs.clip_low, 1.0 + coefs.clip_high)
    pg = torch.maximum(pg_unclipped, pg_clipped)
    dual_bound = -adv_B1 * coefs.clip_ratio_c
    pg_dual = torch.where(adv_B1 < 0, torch.minimum(pg, dual_bound), pg)
    if coefs.correction is not None:
        pg_dual = pg_dual * correction_weights(old_logp_BT, behav_logp_BT, weight_BT > 0, coefs.correction)
    kl = k3_kl(logp_BT, ref_logp_BT, weight_BT > 0) if coefs.kl_coef > 0 else None
    loss = (weight_BT * (pg_dual + coefs.kl_coef * kl if kl is not None else pg_dual)).sum()

    with torch.no_grad():
        w = weight_BT
        clipped_up = (pg_clipped > pg_unclipped) & (adv_B1 > 0)    # ratio above 1+ε_high, Â>0
        clipped_low = (pg_clipped > pg_unclipped) & (adv_B1 < 0)   # ratio below 1−ε_low, Â<0
        dual = (pg > dual_bound) & (adv_B1 < 0)
        sums = {   # verl's names mean verl's quantities: its pg_clipfrac_lower is the dual-clip share
            "actor/pg_loss": (w * pg_dual).sum(),
            "actor/ppo_kl": (w * -log_ratio).sum(),
            "actor/abs_log_ratio": (w * log_ratio.abs()).sum(),   # 0 exactly iff every ratio is 1
            "actor/pg_clipfrac": (w * (clipped_up | clipped_low).float()).sum(),
            "actor/pg_clipfrac_lower": (w * dual.float()).sum(),
            "actor/pg_clipfrac_below": (w * clipped_low.float()).sum(),
            **({"actor/kl_loss": (w * kl).sum()} if kl is not None else {}),
        }
    return loss, sums
