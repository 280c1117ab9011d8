"""The GRPO loss against closed-form cases, and its token-mean invariance to splitting."""
import math

import pytest
import torch

from ds_twocircuit.grpo.advantages import group_advantages, zero_advantage_groups
from ds_twocircuit.grpo.logprobs import token_logprobs
from ds_twocircuit.grpo.loss import LossCoefs, grpo_token_loss
from ds_twocircuit.grpo.rollouts import Rollout, nonzero_advantage_rows, nonzero_advantage_tokens
from ds_twocircuit.sampler.reference import pack, unpack

C = LossCoefs(clip_low=0.2, clip_high=0.28, clip_ratio_c=3.0, kl_coef=0.1)


def one_token(log_ratio, adv, ref_diff=0.0, coefs=C):
    """Loss of a single token (weight 1) with logp = 0 → old = −log_ratio, ref = ref_diff."""
    logp = torch.zeros(1, 1, requires_grad=True)
    loss, sums = grpo_token_loss(logp, torch.full((1, 1), -log_ratio), torch.full((1, 1), ref_diff),
                                 torch.tensor([adv]), torch.ones(1, 1), coefs)
    loss.backward()
    return float(loss.detach()), float(logp.grad), {k: float(v) for k, v in sums.items()}


def test_ratio_one_is_minus_advantage():
    loss, grad, s = one_token(0.0, 1.5)
    assert loss == -1.5 and s["actor/pg_clipfrac"] == 0.0
    assert math.isclose(grad, -1.5)                      # d(−Âρ)/dlogp = −Âρ


def test_upper_clip_when_advantage_positive():
    loss, grad, s = one_token(math.log(2.0), 1.0)
    assert math.isclose(loss, -1.28, rel_tol=1e-6)        # −Â·(1+ε_high)
    assert grad == 0.0 and s["actor/pg_clipfrac"] == 1.0


def test_lower_clip_when_advantage_negative():
    loss, grad, s = one_token(math.log(0.5), -1.0)
    assert math.isclose(loss, 0.8, rel_tol=1e-6)          # −Â·(1−ε_low)
    assert grad == 0.0 and s["actor/pg_clipfrac_below"] == 1.0 and s["actor/pg_clipfrac_lower"] == 0.0


def test_dual_clip_caps_negative_advantage_loss():
    loss, grad, s = one_token(math.log(5.0), -2.0)
    assert math.isclose(loss, 6.0, rel_tol=1e-6)          # min(−Âρ = 10, −Â·c = 6)
    assert grad == 0.0 and s["actor/pg_clipfrac_lower"] == 1.0                # verl's name for the dual-clip share
    loss, _, s = one_token(math.log(2.0), -2.0)           # ρ < c: the PPO term stands
    assert math.isclose(loss, 4.0, rel_tol=1e-6) and s["actor/pg_clipfrac_lower"] == 0.0


def test_k3_kl_closed_form():
    d = 0.3
    loss, grad, s = one_token(0.0, 0.0, ref_diff=d)
    kl = math.exp(d) - d - 1
    assert math.isclose(s["actor/kl_loss"], kl, rel_tol=1e-6)
    assert math.isclose(loss, 0.1 * kl, rel_tol=1e-6)
    assert math.isclose(grad, 0.1 * (1 - math.exp(d)), rel_tol=1e-5)   # d/dlogp of e^{r−l} − (r−l) − 1
    assert one_token(0.0, 0.0, ref_diff=0.0)[2]["actor/kl_loss"] == 0.0


def verl_reference(logp, old, ref, adv_B, mask, coefs):
    """verl's `compute_policy_loss` (vanilla, dual-clip) and `kl_penalty` (low_var_kl), token-mean,
    transcribed from its core_algos: the quantities behind the keys we share with it."""
    mean = lambda x: (x * mask).sum() / mask.sum()
    adv = adv_B[:, None]
    neg_kl = torch.clamp(logp - old, -20.0, 20.0)
    ratio = torch.exp(neg_kl)
    pg1, pg2 = -adv * ratio, -adv * torch.clamp(ratio, 1 - coefs.clip_low, 1 + coefs.clip_high)
    clip1 = torch.maximum(pg1, pg2)
    pg3 = -adv * coefs.clip_ratio_c
    pg = torch.where(adv < 0, torch.min(pg3, clip1), clip1)
    kl = torch.clamp(ref - logp, -20, 20)
    kld = torch.clamp(torch.exp(kl) - kl - 1, -10, 10)          # its second clamp: not ours, does not bind here
    return {"actor/pg_loss": mean(pg), "actor/ppo_kl": mean(-neg_kl), "actor/pg_clipfrac": mean(torch.gt(pg2, pg1).float()),
            "actor/pg_clipfrac_lower": mean(torch.gt(clip1, pg3).float() * (adv < 0).float()), "actor/kl_loss": mean(kld),
            "loss": mean(pg) + coefs.kl_coef * mean(kld)}


def test_the_keys_we_share_with_verl_mean_what_they_mean_there():
    """On a random batch with every clip binding somewhere: each shared key, the loss and its
    gradient equal verl's to 1e-6 relative (float32), pg_clipfrac_lower being the dual-clip share."""
    g = torch.Generator().manual_seed(3)
    B, T = 16, 12
    logp = (-torch.rand(B, T, generator=g) * 3).requires_grad_()
    old = logp.detach() + torch.randn(B, T, generator=g) * 0.6
    ref = logp.detach() + torch.randn(B, T, generator=g) * 0.5
    adv = torch.randn(B, generator=g) * 2
    mask = (torch.rand(B, T, generator=g) > 0.3).float()
    coefs = LossCoefs(kl_coef=0.1)
    loss, sums = grpo_token_loss(logp, old, ref, adv, mask / mask.sum(), coefs)
    grad, = torch.autograd.grad(loss, logp)
    want = verl_reference(logp, old, ref, adv, mask, coefs)
    want_grad, = torch.autograd.grad(want.pop("loss"), logp)
    assert 0 < float(want["actor/pg_clipfrac_lower"]) < float(want["actor/pg_clipfrac"])
    d = ref - logp.detach()
    assert float((torch.exp(d) - d - 1).max()) < 10          # verl's estimate clamp, which we leave out, binds nowhere
    for k, v in want.items():
        assert math.isclose(float(sums[k]), float(v), rel_tol=1e-6, abs_tol=1e-7), (k, float(sums[k]), float(v))
    torch.testing.assert_close(grad, want_grad, rtol=1e-6, atol=1e-8)


def test_the_kl_term_counts_only_where_it_can_and_never_makes_a_nan():
    """A target far below the reference off the response (log-prob −100, reference placeholder 0:
    e^100 is inf in float32) leaves the loss and its gradient finite; at β = 0 there is no KL at all
    (no actor/kl_loss); where the clamp of d to ±20 does not bind and nothing was masked the numbers
    are the unmasked formula's bit for bit; past it (d = 30 on the response: e^30 − 31) d counts 20."""
    g = torch.Generator().manual_seed(4)
    B, T = 4, 6
    logp = (-torch.rand(B, T, generator=g)).requires_grad_()
    ref = logp.detach() + torch.randn(B, T, generator=g) * 0.3
    w = torch.ones(B, T) / (B * T)
    adv = torch.randn(B, generator=g)
    loss, sums = grpo_token_loss(logp, logp.detach(), ref, adv, w, C)
    d = ref - logp.detach()
    assert float(sums["actor/kl_loss"]) == float((w * (torch.exp(d) - d - 1.0)).sum())   # bit for bit
    far = logp.detach().clone()
    far[0, 0] = -100.0
    far.requires_grad_()
    w_off = w.clone()
    w_off[0, 0] = 0.0                                  # off the response: its reference is a placeholder
    ref_off = ref.clone()
    ref_off[0, 0] = 0.0
    loss, sums = grpo_token_loss(far, far.detach(), ref_off, adv, w_off, C)
    grad, = torch.autograd.grad(loss, far)
    assert torch.isfinite(loss) and torch.isfinite(grad).all() and torch.isfinite(sums["actor/kl_loss"])
    _, sums0 = grpo_token_loss(far, far.detach(), ref_off, adv, w_off, LossCoefs(kl_coef=0.0))
    assert "actor/kl_loss" not in sums0
    _, _, s = one_token(0.0, 0.0, ref_diff=30.0)
    assert s["actor/kl_loss"] == pytest.approx(math.exp(20.0) - 21.0, rel=1e-6)


def test_token_mean_invariant_to_split():
    g = torch.Generator().manual_seed(0)
    B, T = 6, 9
    logp = torch.randn(B, T, generator=g) * 0.1 - 1
    old = logp + torch.randn(B, T, generator=g) * 0.3
    ref = logp + torch.randn(B, T, generator=g) * 0.3
    adv = torch.randn(B, generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.3).float()
    w = mask / mask.sum()
    whole, _ = grpo_token_loss(logp, old, ref, adv, w, C)
    parts = sum(grpo_token_loss(logp[s], old[s], ref[s], adv[s], w[s], C)[0]
                for s in (slice(0, 1), slice(1, 4), slice(4, 6)))
    torch.testing.assert_close(whole, parts)
    per_token = whole * mask.sum()
    assert not torch.isclose(per_token / B, whole)        # a per-sequence mean would differ


def test_group_advantages_closed_form():
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]), 4)
    std = torch.tensor([1.0, 0, 0, 0]).std()
    torch.testing.assert_close(adv[:4], (torch.tensor([1.0, 0, 0, 0]) - 0.25) / (std + 1e-6))
    assert torch.equal(adv[4:], torch.zeros(4))           # no signal in a solved group


def test_all_equal_groups_get_exactly_zero_advantage():
    """In float32 the mean of (0.9, 0.9, 0.9) is not 0.9: r − mean leaves a 6e-8 residue and the std
    another, and (r − mean) / (std + ε) made advantages of up to 0.056 out of them (measured before
    the fix). All-equal groups get exactly 0."""
    r = torch.tensor([0.9, 0.9, 0.9, 1.0, 0.0, 0.0, 0.7, 0.7, 0.7])
    adv = group_advantages(r, 3)
    assert torch.equal(adv[:3], torch.zeros(3)) and torch.equal(adv[6:], torch.zeros(3))
    assert torch.equal(zero_advantage_groups(r, 3), torch.tensor([True, False, True]))
    assert torch.allclose(adv[3:6], torch.tensor([2.0, -1.0, -1.0]) / 3 ** 0.5, atol=1e-5)


def test_nonzero_advantage_rows_keep_their_order_and_pad_with_weight_zero():
    n, T = 8, 5
    r = Rollout(torch.arange(n * T).view(n, T), torch.ones(n, T, dtype=torch.long), torch.ones(n, T - 1),
                torch.zeros(n, T - 1), torch.zeros(n), torch.tensor([0, 0, 1., -1, 0, 0, 2, -2]), torch.arange(n))
    out, idx = nonzero_advantage_rows(r, micro=3)
    assert idx.tolist() == [2, 3, 6, 7, -1, -1]
    assert out.sample_id_N.tolist() == [2, 3, 6, 7, 2, 3]      # cycled: a pad of whole groups
    assert out.resp_NT1.sum(1).tolist() == [4, 4, 4, 4, 0, 0]
    assert nonzero_advantage_tokens(r, 2) == [8.0, 8.0]
    none, idx = nonzero_advantage_rows(Rollout(*[t[:2] for t in r.tensors()]), micro=3)
    assert idx.tolist() == [-1, -1, -1] and none.resp_NT1.sum() == 0    # one micro-batch of weight 0


def test_reference_logprobs_travel_as_the_response_tokens_only():
    resp = torch.tensor([[0, 1, 1, 0], [0, 0, 1, 1.]])
    values = torch.randn(2, 4) * resp
    flat = pack(values, resp)
    assert flat.shape == (4,) and torch.equal(unpack(flat, resp), values)


def test_token_logprobs_temperature():
    logits = torch.randn(2, 3, 5)
    tgt = torch.randint(5, (2, 3))
    lp, ent = token_logprobs(logits, tgt, temperature=0.5)
    ref = torch.log_softmax(logits / 0.5, -1).gather(-1, tgt[..., None])[..., 0]
    torch.testing.assert_close(lp, ref)
    assert (ent >= 0).all()


def test_response_lengths_tell_clipped_from_complete():
    """Three responses in target coordinates, max_new_tokens = 3, eos = 9: one ends in eos early,
    one ends in eos on its last allowed token (complete, though verl would count it), one uses all
    three tokens without eos (clipped)."""
    from ds_twocircuit.grpo.rollouts import Rollout, response_lengths
    ids = torch.tensor([[5, 1, 9, 0, 0], [5, 1, 2, 9, 0], [5, 1, 2, 3, 0]])
    resp = torch.tensor([[1., 1., 0., 0.], [1., 1., 1., 0.], [1., 1., 1., 0.]])
    z = torch.zeros(3)
    got = response_lengths(Rollout(ids, (ids > 0).long(), resp, resp * 0, z, z, torch.arange(3)), 9, 3)
    assert got == pytest.approx({"response_length/mean": 8 / 3, "response_length/max": 3.0, "response_length/min": 2.0,
                                 "response_length/clip_ratio": 1 / 3})


def test_avg_at_k_closed_form():
    """3 problems × 4 passes: pass accuracies 2/3, 1/3, 1/3, 0 → avg 1/3, population std √(1/18)."""
    from ds_twocircuit.evaluation import avg_at_k
    h = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0], [0, 0, 0, 0]])
    got = avg_at_k(h)
    assert got == pytest.approx({"avg@k": 1 / 3, "spread": math.sqrt(1 / 18), "pass@k": 2 / 3})
