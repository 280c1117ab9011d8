"""sign(M) on the wire (1 bit per parameter) and the optimizer-side correction (pure).

Packing: bit i of the flat parameter vector is 1 where M_i > 0 and 0 where M_i ≤ 0; bits are
little-endian within a byte, so P parameters take ⌈P/8⌉ bytes. M_i = 0 (a coordinate the anchor's
replay never touched: an untied embedding row of a token absent from its batch) has no sign, and a
bit cannot say so; the runs of such coordinates travel beside the bits as (start, length) pairs,
16 bytes a run, none at all in the usual case. The trainer holds s_i ∈ {−1, 0, +1} (int8).

Correction, applied to every gradient before the optimizer consumes it:

    G = α·G_comp + (1 − α)·|G_comp| ⊙ s            (α = 0.25)

which, coordinate by coordinate, is G_comp where s agrees with sign(G_comp) and (2α − 1)·G_comp
where it does not (and 0 where G_comp = 0). Where s = 0 the anchor has no opinion and G = G_comp
(the formula would halve it). It is computed in that form, so where every sign agrees the gradient
is returned bit for bit, and the optimizer step is exactly the plain one. Agreement
(`anchor/sign_agreement`) counts the coordinates with a sign where sign(G_comp) = s, zeros of
G_comp included.
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


def zero_runs(m: torch.Tensor) -> torch.Tensor:
    """The runs of M = 0 in the flat view of m → (R, 2) int64 [start, length], in order."""
    z = torch.nn.functional.pad((m.detach().reshape(-1) == 0).to(torch.int8), (1, 1))
    edges = torch.nonzero(z[1:] - z[:-1]).flatten().cpu()      # starts and ends, alternating
    return torch.stack([edges[0::2], edges[1::2] - edges[0::2]], 1) if len(edges) else torch.zeros(0, 2, dtype=torch.long)


def signs_of(bits: torch.Tensor, runs: torch.Tensor) -> torch.Tensor:
    """Flat bits (True: M > 0) and the zero runs → s ∈ {−1, 0, +1} int8, on the bits' device."""
    s = bits.to(torch.int8) * 2 - 1
    for start, length in runs.tolist():
        s[start:start + length] = 0
    return s


def corrected_gradient(g: torch.Tensor, s: torch.Tensor, alpha: float) -> torch.Tensor:
    """α·g + (1−α)·|g|·s for s ∈ {−1, 0, +1} (int8) of g's shape (any layout); g where s = 0."""
    keep = ((g > 0) == (s > 0)) | (g == 0) | (s == 0)
    return torch.where(keep, g, g * (2.0 * alpha - 1.0))


def agreement_count(g: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(coordinates with a sign where sign(g) = s, zeros of g agreeing; coordinates with a sign), as
    0-dim tensors on g's device (no host read per tensor)."""
    signed = s != 0
    return ((((g > 0) == (s > 0)) | (g == 0)) & signed).sum(), signed.sum()
