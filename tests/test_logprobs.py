"""Chunked log-probs from the head (grpo/logprobs.py) against the whole-vocabulary ones.

With one chunk the arithmetic is the whole-vocabulary path's, so log-probs, entropies and both
gradients are bitwise equal; with several chunks only ∂L/∂W's sum over chunks changes order, and it
stays within the bound the module derives. The upstream gradient is the GRPO loss's, as the last stage
sees it."""
import pytest
import torch
import torch.nn.functional as F

from ds_twocircuit.grpo.logprobs import chunk_rows, head_logprobs, token_logprobs
from ds_twocircuit.grpo.loss import LossCoefs, grpo_token_loss

B, T, D, V, TAU = 3, 7, 16, 37, 0.7


def case(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, T, D, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(V, D, generator=g) * 0.3).to(dtype).requires_grad_()
    targets = torch.randint(V, (B, T), generator=g)
    old = -torch.rand(B, T, generator=g) * 3
    adv = torch.tensor([1.0, -0.5, 0.25])
    weight = (torch.rand(B, T, generator=g) > 0.2).float() / (B * T)
    return h, w, targets, old, adv, weight


def grpo_grads(logprobs_fn, h, w, targets, old, adv, weight):
    """(logp, entropy, ∂L/∂h, ∂L/∂W) of the GRPO loss (with a KL term) through `logprobs_fn`."""
    h.grad = w.grad = None
    logp, entropy = logprobs_fn(h, w, targets)
    loss, _ = grpo_token_loss(logp, old, old - 0.1, adv, weight, LossCoefs(kl_coef=0.05))
    (loss * 4).backward()
    return logp.detach(), entropy, h.grad.clone(), w.grad.clone()


whole = lambda h, w, t: token_logprobs(F.linear(h, w), t, TAU)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_chunk_is_bitwise_the_whole_vocabulary_path(dtype):
    c = case(dtype)
    want = grpo_grads(whole, *c)
    got = grpo_grads(lambda h, w, t: head_logprobs(h, w, t, TAU, rows=B * T), *c)
    for name, a, b in zip(["logp", "entropy", "grad h", "grad W"], got, want):
        assert a.dtype == b.dtype and torch.equal(a, b), name


def bounds(h, w, targets, old, adv, weight, dtype):
    """What a chunk's matmul may move, per quantity, to first order (u = fp32 unit roundoff, u_w =
    the head dtype's). A logit z = h·w/τ is an fp32 sum of D products, each order within (D − 1)·u·
    Σ|h||w| of the exact one; in bf16 the logit is then rounded (u_w·|z|): δz_t = max_v of that.
    log-softmax is 2-Lipschitz in ∞-norm: |Δlogp| ≤ 2δz. The entropy's gradient in z has 1-norm
    Σ p|z − z̄| ≤ 2·max|z|: |ΔH| ≤ 2·max|z|·δz. ∂L/∂z = g·(onehot − p)/τ moves by g·Δp with
    ‖Δp‖₁ ≤ 2δz, and ∂L/∂h = (∂L/∂z)·W is a sum of V products: |Δ∂h| ≤ |g|·2δz·max|W|/τ + 2(V − 1)u·
    |∂L/∂z|·|W| (and 2·u_w of that in bf16, the product's rounding). ∂L/∂W = Σ_t (∂L/∂z_t)ᵀ h_t over N tokens: |Δ∂W| ≤ 2(N − 1)u·S + Σ_t |Δ∂z_t|·|h_t|, and in
    bf16 3·u_w·S (each chunk's product, their sum, the whole one, rounded), S = Σ_t |∂L/∂z_t|ᵀ·|h_t|.
    Each bound gets 8 ulps of its own quantity for the elementwise ops after the matmul."""
    u, u_w = torch.finfo(torch.float32).eps / 2, torch.finfo(dtype).eps / 2
    hf, wf = h.detach().float(), w.detach().float()
    z = F.linear(hf, wf) / TAU                                                    # (B, T, V)
    dz = (2 * (D - 1) * u * F.linear(hf.abs(), wf.abs()) / TAU
          + (u_w * z.abs() if dtype != torch.float32 else 0)).amax(-1)           # (B, T)
    zq = z.requires_grad_()
    logp_all = torch.log_softmax(zq, -1)
    logp = logp_all.gather(-1, targets[..., None])[..., 0]
    loss, _ = grpo_token_loss(logp, old, old - 0.1, adv, weight, LossCoefs(kl_coef=0.05))
    (g_z,) = torch.autograd.grad(loss * 4, zq)                                    # ∂L/∂(z), (B, T, V)
    g_t = g_z.abs().sum(-1) / 2                                                   # |g| per token (Σ|onehot − p| = 2(1 − p_t))
    ulp = lambda x: 8 * u * x.abs()
    S = (g_z / TAU).abs().reshape(-1, V).T @ hf.abs().reshape(-1, D)
    d_gz = (g_t * 2 * dz / TAU)[..., None]                                        # ‖Δ∂L/∂(hWᵀ)_t‖₁
    grad_h = g_t[..., None] * 2 * dz[..., None] * wf.abs().amax(0) / TAU \
        + (2 * (V - 1) * u + 2 * u_w) * (g_z / TAU).abs() @ wf.abs()
    grad_w = 2 * (B * T - 1) * u * S + (d_gz.reshape(-1, 1) * hf.abs().reshape(-1, D)).sum(0) \
        + (3 * u_w * S if dtype != torch.float32 else 0)
    return (2 * dz + ulp(logp.detach()), 2 * z.detach().abs().amax(-1) * dz + ulp(z.detach().abs().amax(-1)),
            grad_h, grad_w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunks_stay_within_the_matmul_bound(dtype):
    """Several chunks: a matmul given fewer rows may sum each row's products in another order (the CPU's
    kernels do), so nothing is bitwise; each quantity stays within `bounds`."""
    rows = 4                                     # 21 tokens → 6 chunks, the last one short
    c = case(dtype, seed=1)
    want = grpo_grads(whole, *c)
    got = grpo_grads(lambda h, w, t: head_logprobs(h, w, t, TAU, rows=rows), *c)
    for name, a, b, bound in zip(["logp", "entropy", "grad h", "grad W"], got, want, bounds(*c, dtype)):
        diff = (a.float() - b.float()).abs()
        assert (diff <= bound).all(), (name, float((diff - bound).max()))


def test_chunk_rows_at_the_reference_vocabulary():
    assert chunk_rows(151_936) == 441 and chunk_rows(17) > 10 ** 6 and chunk_rows(2 ** 40) == 1


def test_the_entropy_carries_no_gradient_and_eval_keeps_nothing():
    h, w, targets, *_ = case(torch.float32)
    logp, entropy = head_logprobs(h, w, targets, TAU, rows=5)
    assert logp.requires_grad and not entropy.requires_grad
    with torch.no_grad():
        lp, _ = head_logprobs(h, w, targets, TAU, rows=5)
    assert lp.grad_fn is None and torch.equal(lp, logp.detach())
