"""sign(M) on the wire (1 bit per parameter) and the optimizer-side correction.

Packing: bit i of the flat parameter vector is 1 where M_i > 0 and 0 where M_i ≤ 0, so the
unpacked sign s_i ∈ {+1, −1} (M_i = 0 reads as −1; M is a running mean of real gradients and is
never exactly 0 in practice). Bits are little-endian within a byte: P parameters take ⌈P/8⌉ bytes.

Correction, applied to every gradient before the optimizer consumes it:

    G = α·G_comp + (1 − α)·|G_comp| ⊙ s            (α = 0.25)

which, coordinate by coordinate, is G_comp where s agrees with sign(G_comp) and (2α − 1)·G_comp
where it does not (and 0 where G_comp = 0). It is computed in that form, so where every sign
agrees the gradient is returned bit for bit, and the optimizer step is exactly the plain one.
"""
import math

import numpy as np
import torch


def pack_signs(m: torch.Tensor) -> bytes:
    """Flat view of m → ⌈numel/8⌉ bytes, bit = (m > 0)."""
    bits = (m.detach().reshape(-1) > 0).cpu().numpy()
    return np.packbits(bits, bitorder="little").tobytes()


def unpack_signs(buf: bytes, numel: int) -> torch.Tensor:
    """Bytes → (numel,) float32 of ±1. Raises if the buffer is not ⌈numel/8⌉ bytes."""
    if len(buf) != math.ceil(numel / 8):
        raise ValueError(f"sign buffer holds {len(buf)} bytes, expected {math.ceil(numel / 8)} for {numel} parameters")
    bits = np.unpackbits(np.frombuffer(buf, dtype=np.uint8), count=numel, bitorder="little")
    return torch.from_numpy(bits.astype(np.float32) * 2.0 - 1.0)


def corrected_gradient(g: torch.Tensor, s: torch.Tensor, alpha: float) -> torch.Tensor:
    """α·g + (1−α)·|g|·s for s ∈ {±1}, g and s of the same shape (any layout, e.g. flat partitions)."""
    agree = (g > 0) == (s > 0)
    return torch.where(agree | (g == 0), g, g * (2.0 * alpha - 1.0))


def sign_agreement(g: torch.Tensor, s: torch.Tensor) -> float:
    """Fraction of coordinates where sign(g) = s (`anchor/sign_agreement`); zeros count as agreeing."""
    agree = ((g > 0) == (s > 0)) | (g == 0)
    return float(agree.float().mean())
