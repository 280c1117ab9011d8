"""sign(M) on the wire (1 bit per parameter) and the optimizer-side correction (pure).

Packing: bit i of the flat parameter vector is 1 where M_i > 0 and 0 where M_i ≤ 0, so the sign
s_i ∈ {+1, −1} is read as the bool s_i > 0 (M_i = 0 reads as −1; M is a running mean of real
gradients and is never exactly 0 in practice). Bits are little-endian within a byte: P parameters
take ⌈P/8⌉ bytes.

Correction, applied to every gradient before the optimizer consumes it:

    G = α·G_comp + (1 − α)·|G_comp| ⊙ s            (α = 0.25)

which, coordinate by coordinate, is G_comp where s agrees with sign(G_comp) and (2α − 1)·G_comp
where it does not (and 0 where G_comp = 0). It is computed in that form, so where every sign
agrees the gradient is returned bit for bit, and the optimizer step is exactly the plain one.
Agreement (`anchor/sign_agreement`) counts the coordinates where sign(G_comp) = s, zeros included.
"""
import math

import numpy as np
import torch


def pack_bits(bits: torch.Tensor) -> bytes:
    """A bool tensor (any shape, read flat) → ⌈numel/8⌉ bytes."""
    return np.packbits(bits.reshape(-1).cpu().numpy(), bitorder="little").tobytes()


def pack_signs(m: torch.Tensor) -> bytes:
    """Flat view of m → ⌈numel/8⌉ bytes, bit = (m > 0)."""
    return pack_bits(m.detach() > 0)


def unpack_bits(buf: bytes, numel: int) -> torch.Tensor:
    """Bytes → (numel,) bool, True where M > 0. Raises if the buffer is not ⌈numel/8⌉ bytes."""
    if len(buf) != math.ceil(numel / 8):
        raise ValueError(f"sign buffer holds {len(buf)} bytes, expected {math.ceil(numel / 8)} for {numel} parameters")
    return torch.from_numpy(np.unpackbits(np.frombuffer(buf, dtype=np.uint8), count=numel, bitorder="little")
                            .astype(bool))


def corrected_gradient(g: torch.Tensor, s: torch.Tensor, alpha: float) -> torch.Tensor:
    """α·g + (1−α)·|g|·s for s > 0 ⇔ +1 (bool or ±1), g and s of the same shape (any layout)."""
    agree = (g > 0) == (s > 0)
    return torch.where(agree | (g == 0), g, g * (2.0 * alpha - 1.0))


def agreement_count(g: torch.Tensor, s: torch.Tensor) -> int:
    """How many coordinates have sign(g) = s, for a bool s (True ⇔ +1); zeros count as agreeing."""
    return int(((g > 0) == s).sum() + ((g == 0) & s).sum())
