"""Token log-probabilities and entropies of softmax(logits/τ), without the (B, T, V) logits in fp32.

At the reference shape (vocabulary V = 151,936) one fp32 copy of a micro-batch's logits is 0.6 MB per
token, 9.3 GiB at 4 × 4096 tokens, and the whole-vocabulary way (`token_logprobs`: cast, divide,
log-softmax, exponentiate for the entropy) holds about three such copies at once. `head_logprobs`
takes the final hidden states and the head's weight instead and makes the logits `chunk_rows(V)`
tokens at a time (a chunk's fp32 logits ≤ 256 MiB: 441 tokens at V = 151,936), keeping only per-token
results; its backward makes each chunk's logits again (one more matmul, as a fused linear
cross-entropy does) instead of keeping them.

Per token the arithmetic is `token_logprobs`' on `F.linear(h, W)`: z = (h·Wᵀ in the head's dtype) → fp32
→ /τ → log-softmax, logp = z[target], entropy = −Σ e^logp·logp (no gradient). So log-probs,
entropies and ∂L/∂h equal the whole-vocabulary ones bit for bit wherever a matmul's row does not depend
on how many rows it is given; ∂L/∂W = Σ_chunks (∂L/∂z_c)ᵀ·h_c is summed over chunks in fp32 and cast
once to W's dtype, so with one chunk it is bitwise the whole-vocabulary gradient and with n chunks
it differs only by the order of that sum: |Δ| ≤ (n − 1)·u·Σ_c |(∂L/∂z_c)ᵀ·h_c| (u = 2⁻²⁴) plus, for a
bf16 W, one rounding of each (bf16) chunk product and of the sum.
"""
import torch
import torch.nn.functional as F

CHUNK_BYTES = 2 ** 28   # one chunk's fp32 logits


def chunk_rows(vocab: int) -> int:
    """Tokens per chunk: the most whose fp32 logits fit CHUNK_BYTES (at least 1)."""
    return max(1, CHUNK_BYTES // (4 * vocab))


def token_logprobs(logits_BTV: torch.Tensor, targets_BT: torch.Tensor, temperature: float = 1.0):
    """log softmax(logits/τ) at the target ids → (logp_BT, entropy_BT), from whole-vocabulary logits
    (fp32). The entropy carries no gradient."""
    logp_BTV = torch.log_softmax(logits_BTV.float() / temperature, dim=-1)
    logp_BT = logp_BTV.gather(-1, targets_BT.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        entropy_BT = -(logp_BTV.exp() * logp_BTV).sum(-1)
    return logp_BT, entropy_BT


def head_logprobs(h_BTD: torch.Tensor, weight_VD: torch.Tensor, targets_BT: torch.Tensor,
                  temperature: float = 1.0, rows: int | None = None):
    """`token_logprobs(F.linear(h, W), targets, τ)` a chunk of `rows` tokens at a time (default
    chunk_rows(V)) → (logp_BT, entropy_BT); differentiable in h and W, the entropy not at all."""
    B, T, D = h_BTD.shape
    rows = rows or chunk_rows(weight_VD.shape[0])
    logp_N, entropy_N = _HeadLogProbs.apply(h_BTD.reshape(B * T, D), weight_VD, targets_BT.reshape(-1),
                                            temperature, rows)
    return logp_N.view(B, T), entropy_N.view(B, T)


def _chunk_logprobs(h_cD, weight_VD, targets_c, temperature):
    logp_cV = torch.log_softmax(F.linear(h_cD, weight_VD).float() / temperature, dim=-1)
    return logp_cV, logp_cV.gather(-1, targets_c.unsqueeze(-1)).squeeze(-1)


class _HeadLogProbs(torch.autograd.Function):
    """(h_ND, W_VD, targets_N) → (logp_N, entropy_N); keeps h, W and the targets, never the logits."""

    @staticmethod
    def forward(ctx, h_ND, weight_VD, targets_N, temperature, rows):
        logp, entropy = [], []
        with torch.no_grad():
            for s in range(0, h_ND.shape[0], rows):
                logp_cV, logp_c = _chunk_logprobs(h_ND[s:s + rows], weight_VD, targets_N[s:s + rows], temperature)
                logp.append(logp_c)
                entropy.append(-(logp_cV.exp() * logp_cV).sum(-1))
        ctx.save_for_backward(h_ND, weight_VD, targets_N)
        ctx.temperature, ctx.rows = temperature, rows
        entropy_N = torch.cat(entropy)
        ctx.mark_non_differentiable(entropy_N)
        return torch.cat(logp), entropy_N

    @staticmethod
    def backward(ctx, grad_logp_N, _grad_entropy):
        h_ND, weight_VD, targets_N = ctx.saved_tensors
        grad_h = torch.empty_like(h_ND) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(weight_VD.shape, dtype=torch.float32, device=weight_VD.device) \
            if ctx.needs_input_grad[1] else None
        w = weight_VD.detach().requires_grad_(grad_w is not None)    # one leaf for every chunk
        for s in range(0, h_ND.shape[0], ctx.rows):
            e = s + ctx.rows
            with torch.enable_grad():
                h_c = h_ND[s:e].detach().requires_grad_(grad_h is not None)
                _, logp_c = _chunk_logprobs(h_c, w, targets_N[s:e], ctx.temperature)
                wrt = [t for t in (h_c, w) if t.requires_grad]
                grads = list(torch.autograd.grad(logp_c, wrt, grad_logp_N[s:e]))
            if grad_h is not None:
                grad_h[s:e] = grads.pop(0)
            if grad_w is not None:
                grad_w += grads.pop(0)
        return grad_h, None if grad_w is None else grad_w.to(weight_VD.dtype), None, None, None
