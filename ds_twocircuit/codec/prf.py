"""The keyed PRF that picks each token's kept channels: a wire protocol, computed at both ends.

Protocol v1. All arithmetic is on unsigned 32-bit values held in int64 tensors; both multiplier
constants are below 2^31, so every product fits in 63 bits: the same integers on any device and in
any language, with no overflow anywhere.

    mix32(x)        = x ^= x>>16; x *= 0x21f0aaad; x ^= x>>15; x *= 0x735a2d97; x ^= x>>15
                      (mod 2^32; a two-round integer hash from C. Wellons' hash-prospector)
    token key       h = fold of mix32(h ^ field) over (seed, layer, step, sample, position),
                      starting from h = 0x243f6a88; each field < 2^32
    permutation π_h of [0, d): a 4-round unbalanced Feistel network on b = bitlen(d−1) bits,
                      halves of a = ⌊b/2⌋ (left) and b − a (right) bits; round i:
                      (L, R) → (R, L ^ (mix32(R ^ rk_i) mod 2^|L|)), the widths swapping each round,
                      rk_i = mix32(h ^ ((i+1)·0x9e3779b9 mod 2^32)); cycle-walking until < d
                      (2^b < 2d, so under two evaluations per index on average)
    kept set        K_h = sort{π_h(0), π_h(1), ..., π_h(k−1)}: exactly k distinct channels

`layer` is the index of the decoder layer after which the cut sits, `sample` the stable id of the
sequence within the step's batch, `position` the token's position (pads excluded from the count),
so the set does not depend on batch layout, micro-batch split, pipeline partition or device. The
cost per token is O(k) Feistel evaluations, independent of d. A PRP's first k outputs are a
uniformly random k-subset, so each channel is kept with probability k/d and the receiver's scale
d/k makes the decoded activation unbiased.
"""
import torch

M32 = 0xFFFFFFFF
# cycle-walking evaluations between two host reads of what is still out of range: each read
# (nonzero) is a sync on a GPU; a value is out of range with probability (2^b − d)/2^b < 1/2 per
# evaluation (1/4 at d = 1536), so each read finds at most 1/16 (1/256) of the last one's values
WALKS = 4
_KEY_INIT = 0x243F6A88
_GOLDEN = 0x9E3779B9
ROUNDS = 4


def mix32(x: torch.Tensor) -> torch.Tensor:
    """x < 2^32 → uint32 hash; x · c < 2^63 since c < 2^31, so int64 never overflows."""
    x = x ^ (x >> 16)                       # a fresh tensor: the in-place ops below never touch the input
    x.mul_(0x21F0AAAD).bitwise_and_(M32)
    x.bitwise_xor_(x >> 15)
    x.mul_(0x735A2D97).bitwise_and_(M32)
    return x.bitwise_xor_(x >> 15)


def token_keys(seed: int, layer: int, step: int, sample: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """Per-token keys h (int64 holding uint32), broadcast over sample × position shapes."""
    for name, v in (("seed", seed), ("layer", layer), ("step", step)):
        if not 0 <= v <= M32:
            raise ValueError(f"PRF field {name}={v} outside [0, 2^32)")
    sample, position = torch.broadcast_tensors(sample.long(), position.long())
    h = torch.full_like(sample, _KEY_INIT)
    for field in (seed, layer, step):
        h = mix32(h ^ field)
    return mix32(mix32(h ^ (sample & M32)) ^ (position & M32))


def _feistel(j: torch.Tensor, rks: list[torch.Tensor], bits: int) -> torch.Tensor:
    wl, wr = bits // 2, bits - bits // 2
    left, right = j >> wr, j & ((1 << wr) - 1)
    for rk in rks:   # (L: wl bits, R: wr bits) → (R: wr bits, L ^ F(R): wl bits)
        left, right = right, left ^ (mix32(right ^ rk) & ((1 << wl) - 1))
        wl, wr = wr, wl
    return (left << wr) | right


def kept_channels(keys: torch.Tensor, d: int, k: int) -> torch.Tensor:
    """keys (...,) → kept channel indices (..., k), int64, sorted ascending, exactly k distinct."""
    if not 1 <= k <= d:
        raise ValueError(f"keep k={k} must be in [1, d={d}]")
    if k == d:       # every channel, sorted: what the permutation below gives, without computing it
        return torch.arange(d, device=keys.device).expand(*keys.shape, d)
    bits = max(2, (d - 1).bit_length())
    flat = keys.reshape(-1)
    rks = [mix32(flat ^ ((i + 1) * _GOLDEN & M32)) for i in range(ROUNDS)]      # (N,)
    idx = _feistel(torch.arange(k, device=keys.device).expand(flat.numel(), k), [r[:, None] for r in rks], bits)
    rows, cols = (idx >= d).nonzero(as_tuple=True)
    for _ in range(512 // WALKS):  # cycle-walk only the out-of-range values back into [0, d)
        if rows.numel() == 0:
            return idx.sort(dim=-1).values.view(*keys.shape, k)
        walked, rk = idx[rows, cols], [r[rows] for r in rks]
        for _ in range(WALKS):     # a value already in range stays: the same walk as one at a time
            walked = torch.where(walked >= d, _feistel(walked, rk, bits), walked)
        idx[rows, cols] = walked
        still = (walked >= d).nonzero(as_tuple=True)[0]
        rows, cols = rows[still], cols[still]
    raise AssertionError("PRF cycle-walking did not converge")


def kept_for(seed: int, layer: int, step: int, sample_B: torch.Tensor, pos_BT: torch.Tensor, d: int, k: int):
    """The kept set of every token of a micro-batch: (B, T, k). sample_B (B,), pos_BT (B, T)."""
    return kept_channels(token_keys(seed, layer, step, sample_B[:, None], pos_BT), d, k)
