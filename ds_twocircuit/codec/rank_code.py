"""The backward's rank-r code (`codec.bwd_rank`): a micro-batch's activation gradient as two thin factors.

At a cut, the gradient of one micro-batch, M = ∂x̂ (n × d, n = B·T token slots), has most of its
energy in a few directions (wide embedded model, d = 384, one GRPO batch: the top 4 singular
directions hold 62–73 % of it at the 7 cuts, the top 16 94–99.5 %), while a random subset of its
rotated coordinates at 2 bits, the rotated codec's own backward, is unbiased but noisy, and that noise
compounds through the cuts. The receiver sends instead the projection of M on an r-dimensional
subspace of its columns, found by a randomized range finder:

    range    Y = M Ω,  Ω (d × (r + p)) standard normal (p = 8 extra columns), drawn from a generator
             seeded by the micro-batch's first token key (only the receiver draws it); then `iters`
             times Y ← M (Mᵀ orth(Y)) (subspace iteration, so Y approaches M's top left space)
    factors  W = orth(Y); the top r left singular vectors U_r of the small Wᵀ M give
             P = W U_r (n × r, orthonormal columns),  Q = Mᵀ P (d × r)
    code     P then Q as bf16 (2 bytes each, little-endian): token slot i holds P's row i, then the
             d·r values of Q (row-major) continue across the slots, ⌈d·r/n⌉ per slot, zero-padded
    decode   M̂ = P Qᵀ = P Pᵀ M, the projection of M on span(P)

A non-finite M decodes to NaNs (the factors of a NaN matrix do not exist), so the step guard sees it
on the sending stage and skips the step, as it would without the codec.

Biased: M̂ drops M's other directions (‖M − M̂‖ is the energy outside the top-r subspace, up to the
range finder's error), and exact to bf16 rounding when rank M ≤ r. It is a code of the micro-batch,
not of each token, so it depends on which tokens share the micro-batch: the gradient (not the loss)
changes with the micro-batch split. Cost: r·(n + d) bf16 values per micro-batch, r + ⌈d·r/n⌉ per slot.
"""
import math

import torch

ITERS = 2
OVERSAMPLE = 8


def slots(n: int, d: int, r: int) -> int:
    """bf16 values per token slot for n slots of width d at rank r."""
    return r + math.ceil(d * r / n)


def _orth(y: torch.Tensor) -> torch.Tensor:
    return torch.linalg.qr(y)[0]


def factors(m_ND: torch.Tensor, r: int, seed: int, iters: int = ITERS) -> tuple[torch.Tensor, torch.Tensor]:
    """(P (n, r), Q (d, r)) float32 with P Qᵀ ≈ M's best rank-r approximation; columns past
    min(n, d) are zero."""
    n, d = m_ND.shape
    k, wide = min(r, n, d), min(r + OVERSAMPLE, n, d)
    m = m_ND.float()
    if not torch.isfinite(m).all():     # stays non-finite across the cut, so the guard skips the step
        return m.new_full((n, r), float("nan")), m.new_full((d, r), float("nan"))
    # drawn on the CPU whatever the device: both ends and every device draw the same Ω
    omega = torch.randn(d, wide, generator=torch.Generator().manual_seed(seed & 0x7FFFFFFFFFFFFFFF)).to(m.device)
    y = m @ omega
    for _ in range(iters):
        y = m @ (m.T @ _orth(y))
    w = _orth(y)
    u, _, _ = torch.linalg.svd(w.T @ m, full_matrices=False)
    p = w @ u[:, :k]
    q = m.T @ p
    pad = lambda t: torch.nn.functional.pad(t, (0, r - k))
    return pad(p), pad(q)


def encode(m_ND: torch.Tensor, r: int, seed: int) -> torch.Tensor:
    """M (n, d) → code (n, 2·slots(n, d, r)) uint8."""
    n, d = m_ND.shape
    p, q = factors(m_ND, r, seed)
    width = slots(n, d, r)
    spill = m_ND.new_zeros(n * (width - r), dtype=torch.bfloat16)
    spill[:d * r] = q.reshape(-1).bfloat16()
    code = torch.cat([p.bfloat16(), spill.view(n, width - r)], dim=1)
    return code.view(torch.uint8)


def decode(code_NB: torch.Tensor, d: int, r: int) -> torch.Tensor:
    """code (n, bytes) → M̂ = P Qᵀ (n, d) float32."""
    n = code_NB.shape[0]
    vals = code_NB.contiguous().view(torch.bfloat16)[:, :slots(n, d, r)].float()
    p, q = vals[:, :r], vals[:, r:].reshape(-1)[:d * r].view(d, r)
    return p @ q.T
