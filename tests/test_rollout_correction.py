"""The rollout correction against verl's formulas, in the loss, and its metrics.

`verl_*` below transcribe verl's `rollout_corr_helper.py` (compute_rollout_correction_weights with
rollout_is="token", compute_is_metrics' mean, max and ESS, compute_rollout_rejection_mask's token_k1
and seq_mean_k1, masked_mean as verl_F writes it): what ours must equal, written from its source,
sharing no code with ours."""
import math

import pytest
import torch

from ds_twocircuit.grpo.loss import LossCoefs, grpo_token_loss
from ds_twocircuit.grpo.rollout_correction import (Correction, correction_sums, correction_weights,
                                                   effective_sample_size, largest_weight)
from ds_twocircuit.metrics.health import mismatch_split, mismatch_sums


def masked_mean(x, mask, axis=None):
    return (x * mask).sum() / (mask.sum() + 1e-8) if axis is None else (x * mask).sum(axis) / (mask.sum(axis) + 1e-8)


def verl_tis(old, rollout, mask, threshold):
    """Token-level TIS: exp(clamp(old − rollout, ±20)) · mask, clamped above at the threshold."""
    raw = torch.exp(torch.clamp(old - rollout, -20.0, 20.0)) * mask
    return raw.clamp(max=threshold), raw


def verl_is_metrics(w, raw, mask, threshold):
    ess_w = w.clamp(min=0.0, max=threshold)
    mean = masked_mean(ess_w, mask)
    return {"mean": masked_mean(w, mask).item(), "max": w.masked_fill(~mask.bool(), float("-inf")).max().item(),
            "fraction_high": masked_mean((raw > threshold).float(), mask).item(),
            "ess": 1.0 / masked_mean((ess_w / (mean + 1e-8)).square(), mask).item()}


def verl_rejection(old, rollout, mask, token=None, seq_mean=None):
    """token_k1 and seq_mean_k1 with "lower_upper" thresholds (verl states them on μ/π_old)."""
    k1 = -torch.clamp(old - rollout, -20.0, 20.0)
    keep = torch.ones_like(mask)
    if token is not None:
        lo, hi = math.log(token[0]), math.log(token[1])
        keep = keep * ((k1 >= lo) & (k1 <= hi)).float()
    if seq_mean is not None:
        lo, hi = math.log(seq_mean[0]), math.log(seq_mean[1])
        s = masked_mean(k1, mask, axis=-1)
        keep = keep * ((s >= lo) & (s <= hi)).float()[:, None].expand_as(mask)
    return mask * keep, masked_mean(1 - keep, mask).item()


def batch(seed=0, B=12, T=9, spread=0.8):
    """Ragged responses, π_old off μ by N(0, spread) nats; as in a real batch, π_old holds log-probs off
    the response too (the prompt's) where μ holds zeros, which no ratio may read."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(B, T)
    for i in range(B):
        lo = int(torch.randint(0, 3, (1,), generator=g))
        mask[i, lo:lo + int(torch.randint(1, T - lo + 1, (1,), generator=g))] = 1.0
    behav = -torch.rand(B, T, generator=g) * 3 * mask
    old = behav + spread * torch.randn(B, T, generator=g) * mask - 2.0 * (1 - mask)
    return old, behav, mask


def test_truncated_weights_and_their_metrics_equal_verls():
    old, behav, mask = batch()
    c = Correction(is_threshold=2.0)
    w_verl, raw = verl_tis(old, behav, mask, 2.0)
    ours = correction_weights(old, behav, mask > 0, c)
    assert torch.equal(ours, w_verl)
    assert (raw > 2.0).any() and ((raw < 2.0) & (mask > 0)).any()      # the truncation binds, not everywhere
    want = verl_is_metrics(w_verl, raw, mask, 2.0)
    s = {k: float(v) for k, v in correction_sums(old, behav, mask / mask.sum(), c).items()}
    assert math.isclose(s["rollout_corr/rollout_is_mean"], want["mean"], rel_tol=1e-6)
    assert math.isclose(s["rollout_corr/rollout_is_ratio_fraction_high"], want["fraction_high"], rel_tol=1e-6)
    assert largest_weight(old, behav, mask > 0, c) == want["max"] == 2.0
    ess = effective_sample_size(s["rollout_corr/rollout_is_mean"], s["rollout_corr/_is_sq"])
    assert math.isclose(ess, want["ess"], rel_tol=1e-5) and 0.3 < ess < 1.0
    assert s["rollout_corr/rollout_rs_masked_fraction"] == 0.0


@pytest.mark.parametrize("token, geometric", [((0.5, 2.0), None), (None, (0.75, 1.25)), ((0.25, 4.0), (0.5, 1.5))])
def test_rejection_equals_verls_token_k1_and_seq_mean_k1(token, geometric):
    """Our bounds on π_old/μ are verl's on μ/π_old inverted: [lo, hi] → [1/hi, 1/lo] (exact for these)."""
    old, behav, mask = batch(seed=1)
    c = Correction(2.0, token, geometric)
    inv = lambda b: (1 / b[1], 1 / b[0]) if b else None
    kept_verl, masked_verl = verl_rejection(old, behav, mask, inv(token), inv(geometric))
    w_verl, _ = verl_tis(old, behav, mask, 2.0)
    ours = correction_weights(old, behav, mask > 0, c)
    assert torch.equal(ours, w_verl * kept_verl)
    assert 0.05 < masked_verl < 0.95, masked_verl                      # some rejected, not all
    masked = float(correction_sums(old, behav, mask / mask.sum(), c)["rollout_corr/rollout_rs_masked_fraction"])
    assert math.isclose(masked, masked_verl, rel_tol=1e-6)


def test_the_loss_multiplies_each_tokens_policy_term_and_nothing_else():
    """With the correction the loss is Σ w·(κ·pg) + β·Σ w·kl, κ the correction weights (verl: pg_losses ×
    rollout_is_weights); its gradient likewise; the KL term is untouched."""
    old, behav, mask = batch(seed=2)
    logp = (old + 0.1 * torch.randn_like(old)).requires_grad_(True)
    ref, adv, w = old - 0.2, torch.randn(old.shape[0]), mask / mask.sum()
    c = Correction(2.0, (0.5, 2.0), None)
    plain = LossCoefs(kl_coef=0.0)
    loss, sums = grpo_token_loss(logp, old, ref, adv, w, LossCoefs(kl_coef=0.0, correction=c), behav)
    (g,) = torch.autograd.grad(loss, logp)
    kappa = correction_weights(old, behav, mask > 0, c)
    # the same loss with κ folded into the token weights
    loss_ref, _ = grpo_token_loss(logp, old, ref, adv, w * kappa, plain)
    (g_ref,) = torch.autograd.grad(loss_ref, logp)
    torch.testing.assert_close(loss, loss_ref, rtol=1e-6, atol=0)
    torch.testing.assert_close(g, g_ref, rtol=1e-6, atol=1e-9)
    kl_on, s_on = grpo_token_loss(logp, old, ref, adv, w, LossCoefs(kl_coef=0.1, correction=c), behav)
    kl_off, s_off = grpo_token_loss(logp, old, ref, adv, w, LossCoefs(kl_coef=0.1), behav)
    assert torch.equal(s_on["actor/kl_loss"], s_off["actor/kl_loss"])
    assert not torch.equal(kl_on, kl_off)


def test_on_with_the_sampler_equal_to_pi_old_is_the_uncorrected_loss_bit_for_bit():
    """μ = π_old: every weight exp(0) = 1, nothing rejected at bounds around 1, so loss and gradient
    are the uncorrected ones exactly (1·x = x in floating point)."""
    old, _, mask = batch(seed=3)
    logp = (old + 0.3 * torch.randn_like(old)).requires_grad_(True)
    ref, adv, w = old - 0.2, torch.randn(old.shape[0]), mask / mask.sum()
    on = LossCoefs(correction=Correction(2.0, (0.5, 2.0), (0.9, 1.1)))
    a, _ = grpo_token_loss(logp, old, ref, adv, w, on, old.clone())
    b, _ = grpo_token_loss(logp, old, ref, adv, w, LossCoefs())
    assert torch.equal(a, b)
    assert torch.equal(torch.autograd.grad(a, logp)[0], torch.autograd.grad(b, logp)[0])


def test_the_split_adds_up_to_the_gap():
    """numerics (sampler − dense) + codec (dense − compressed) = rollout_corr/kl (sampler − compressed)
    on the same tokens; the mean absolute differences are each its own pair's."""
    old, behav, mask = batch(seed=4)
    dense = behav + 0.01 * torch.randn_like(behav)
    w = mask / mask.sum()
    s = {k: float(v) for k, v in mismatch_split(behav, dense, old, w).items()}
    gap = float(mismatch_sums(behav, old, w)["rollout_corr/kl"])
    assert math.isclose(s["mismatch/numerics_kl"] + s["mismatch/codec_kl"], gap, rel_tol=1e-5)
    assert s["mismatch/numerics_logp_diff"] < 0.02 < s["mismatch/codec_logp_diff"]


def test_the_split_with_the_sampler_ahead_adds_up_and_puts_each_difference_in_its_part():
    """With the sampler's log-probs at θ_t (r) beside its own at θ_{t−k} (s): staleness (s − r) +
    numerics (r − d) + codec (d − t) = rollout_corr/kl; a change in r moves staleness and numerics
    against each other and leaves codec alone; without r the keys are the k = 0 split's."""
    old, behav, mask = batch(seed=5)
    rescored = behav + 0.05 * torch.randn_like(behav)
    dense = rescored + 0.001 * torch.randn_like(behav)
    w = mask / mask.sum()
    s = {k: float(v) for k, v in mismatch_split(behav, dense, old, w, rescored).items()}
    gap = float(mismatch_sums(behav, old, w)["rollout_corr/kl"])
    assert math.isclose(s["mismatch/staleness_kl"] + s["mismatch/numerics_kl"] + s["mismatch/codec_kl"], gap,
                        rel_tol=1e-5)
    assert s["mismatch/numerics_logp_diff"] < 0.002 < 0.02 < s["mismatch/staleness_logp_diff"]
    plain = {k: float(v) for k, v in mismatch_split(behav, dense, old, w).items()}
    assert plain.keys() == {k for k in s if "staleness" not in k} and plain["mismatch/codec_kl"] == s["mismatch/codec_kl"]
    assert math.isclose(plain["mismatch/numerics_kl"], s["mismatch/numerics_kl"] + s["mismatch/staleness_kl"],
                        rel_tol=1e-5)
