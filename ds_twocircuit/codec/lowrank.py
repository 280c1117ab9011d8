"""The lowrank codec's bases (pure): an orthonormal Q (d × k) per cut, y = x·Q, x̂ = y·Qᵀ.

    first basis   Q = top-k right singular vectors of the activations X (N × d), no centring
    refresh       Q ← orth(Xᵀ(X·Q))       one subspace (power) iteration on new activations

Both ends of a cut must hold the same Q (the sender computes it and ships it, or the anchor does).
"""
import torch


def top_basis(x_ND: torch.Tensor, k: int) -> torch.Tensor:
    """Orthonormal Q (d, k): the top-k right singular vectors of x (PCA without centring)."""
    _, _, vh = torch.linalg.svd(x_ND.double(), full_matrices=False)
    return vh[:k].T.float().contiguous()


def refresh_basis(x_ND: torch.Tensor, q_Dk: torch.Tensor) -> torch.Tensor:
    """One subspace iteration of q on the activations x (in float64): orth(xᵀ(x·q))."""
    x = x_ND.double()
    q, _ = torch.linalg.qr(x.T @ (x @ q_Dk.double()))
    return q.float().contiguous()


def checked_basis(q_Dk: torch.Tensor, d: int, k: int, layer: int) -> torch.Tensor:
    """q as float32 if it is a (d, k) orthonormal basis; raises ValueError naming the cut otherwise."""
    if q_Dk.shape != (d, k):
        raise ValueError(f"basis for cut {layer}: shape {tuple(q_Dk.shape)}, expected ({d}, {k})")
    gram = q_Dk.double().T @ q_Dk.double()
    if not torch.allclose(gram, torch.eye(k, dtype=torch.float64, device=gram.device), atol=1e-4):
        raise ValueError(f"basis for cut {layer} is not orthonormal")
    return q_Dk.float().contiguous()
