"""The rotated, dithered low-bit boundary codec: a wire protocol, computed at both ends.

Protocol v1 (pure torch; every random quantity is a keyed function of the token, so nothing but
the code crosses the wire). Per token, h = prf.token_keys(seed, layer, step, sample, position) and
h_t = mix32(h ^ t) for the tags t below (prf.py's mix32). For a vector x of width d:

    signs      s_i = 1 − 2·bit(i mod 32) of mix32(h_SIGNS ^ ⌊i/32⌋)             i < d
    rotation   z = R x,  R x = H (s ⊙ x) / √n  blockwise: H the Walsh–Hadamard matrix of order n
               (Sylvester), n the largest power of two dividing d (1536 = 3 × 512); R orthogonal
    subset     S = prf.kept_channels(h_SUBSET, d, m): m distinct rotated coordinates, sorted.
               A smaller m' gives a subset of the same S (a PRP's first m' outputs)
    scale      a = max_{j∈S} |z_j|, rounded up to fp16 (so |z_j| ≤ a); a = 0 sends zeros
    dither     u_j = (mix32(h_DITHER[dir] ^ j) >> 8) / 2^24 ∈ [0, 1)              j < m
    quantize   q_j = round((z_j + a)/Δ + u_j − ½) ∈ {0, …, L},  L = 2^b − 1,  Δ = 2a/L
    code       2 bytes of a (fp16, little-endian) then the q_j as b-bit fields, LSB first,
               ⌈m·b/8⌉ bytes: 2 + ⌈m·b/8⌉ bytes per token
    decode     ẑ_j = (q_j − u_j + ½)·Δ − a  (subtractive dither: ẑ_j − z_j ~ U(−Δ/2, Δ/2),
               independent of z_j, so E ẑ_j = z_j);  x̂ = (d/m)·Rᵀ P_Sᵀ ẑ

Protocol v2 (a budget with tile t > 0; t = 0 is v1, byte for byte) gives each run of t consecutive
coordinates of S (in S's sorted order; the last run may be shorter) its own scale. The max over all
d rotated coordinates of a token grows like √(2 ln d) of their spread, so one scale per token costs
precision at width; a tile's max is that of t coordinates.

    tile scale r_i = the smallest integer in [0, 255] with a_i ≥ max_{j∈tile i} |z_j|, where
               a_i = fp32(fp32(a·r_i) / 255) (both ends compute a_i from (a, r_i) this way; r_i = 255
               gives a_i = a exactly); a_i replaces a in the tile's Δ, quantize and decode
    code       2 bytes of a, then the ⌈m/t⌉ bytes r_i, then the q_j: 2 + ⌈m/t⌉ + ⌈m·b/8⌉ bytes

Gaussian levels (v2, `levels="gauss"`, t > 0, b ≤ 4): rotated coordinates are close to Gaussian, and
for a Gaussian the MSE-optimal b-bit scalar code is Lloyd–Max's, not a uniform grid over ±max (2-bit
NMSE 0.118 against the uniform grid's ~0.33 at d = 384). No dither:

    tile scale σ_i = RMS of tile i's coordinates; a = max_i σ_i rounded up to fp16; r_i = round(255·σ_i/a),
               s_i = fp32(fp32(a·r_i) / 255)
    quantize   q_j = the index of the level c_k (LLOYD_MAX[b], ascending) nearest to z_j/s_i (a tie
               takes the lower); s_i = 0 codes the level nearest 0
    decode     ẑ_j = s_i·c_{q_j}
    code       the same layout and size as the uniform grid's with tiles

Biased, and says how: a Lloyd–Max code of a Gaussian satisfies E[z | ẑ] = ẑ (each level is its
cell's mean), so its error is uncorrelated with ẑ and ẑ shrinks towards 0 (E ẑ² = (1 − NMSE)·E z²).

E x̂ = x: over the dither E ẑ = z_S, and over S each coordinate is kept with probability m/d. The
backward sends the adjoint of the same linear map on the forward's coordinates: the receiver codes
its gradient g with `dir` = backward and m_bwd ≤ m_fwd (a subset of the forward's S, fresh dither),
the sender decodes (d/m_bwd)·Rᵀ P_Sᵀ ĝ, an unbiased estimate of the gradient through the forward.
The keys hold (step, sample, position), so every pass of a step sees the same maps, and no map
depends on the batch layout, micro-batch split or resume.
"""
import math
from dataclasses import dataclass

import torch

from .geometry import levels_problem
from .prf import kept_channels, mix32

SIGNS, SUBSET = 0x5157A001, 0x5157A002
DITHER = {"fwd": 0x5157A003, "bwd": 0x5157A004}
SCALE_BYTES = 2
# Lloyd–Max levels of N(0, 1) (Max 1960), the positive half; the code uses ± each
LLOYD_MAX = {1: (0.7979,), 2: (0.4528, 1.5104), 3: (0.2451, 0.7560, 1.3440, 2.1520),
             4: (0.1284, 0.3881, 0.6568, 0.9424, 1.2562, 1.6180, 2.0690, 2.7326)}


@dataclass(frozen=True)
class Budget:
    """One direction's wire budget: m rotated coordinates of d at b bits each, one scale per token
    (tile 0) or one 8-bit scale per `tile` coordinates as well (protocol v2)."""
    d: int
    m: int
    bits: int
    tile: int = 0
    levels: str = "uniform"          # or "gauss": Lloyd–Max levels, no dither

    def __post_init__(self):
        if not 1 <= self.m <= self.d or not 1 <= self.bits <= 24:
            raise ValueError(f"rotated codec budget m={self.m} of d={self.d} at {self.bits} bits: "
                             "need 1 <= m <= d and 1 <= bits <= 24 (24: lossless to fp32 rounding)")
        if not 0 <= self.tile <= self.m:
            raise ValueError(f"rotated codec tile={self.tile}: need 0 (one scale per token) to m={self.m}")
        if problem := levels_problem(self.levels, self.tile, self.bits):
            raise ValueError(f"rotated codec levels={self.levels!r} at tile={self.tile}, {self.bits} bits: {problem}")

    @property
    def tiles(self) -> int:
        return math.ceil(self.m / self.tile) if self.tile else 0

    @property
    def bytes_per_token(self) -> int:
        return SCALE_BYTES + self.tiles + math.ceil(self.m * self.bits / 8)


def block_size(d: int) -> int:
    return d & -d


def _tagged(keys: torch.Tensor, tag: int) -> torch.Tensor:
    return mix32(keys ^ tag)


def signs(keys_N: torch.Tensor, d: int) -> torch.Tensor:
    """±1 per coordinate, (N, d) int64."""
    words = mix32(_tagged(keys_N, SIGNS)[:, None] ^ torch.arange((d + 31) // 32, device=keys_N.device))   # (N, ⌈d/32⌉)
    bits = (words[:, :, None] >> torch.arange(32, device=keys_N.device)) & 1
    return 1 - 2 * bits.reshape(keys_N.shape[0], -1)[:, :d]


def fwht(x: torch.Tensor) -> torch.Tensor:
    """Unnormalised Walsh–Hadamard transform (Sylvester order) of the last dim (a power of two)."""
    n = x.shape[-1]
    y, h = x.reshape(-1, n), 1
    while h < n:
        y = y.view(-1, n // (2 * h), 2, h)
        y = torch.stack((y[:, :, 0] + y[:, :, 1], y[:, :, 0] - y[:, :, 1]), dim=2).view(-1, n)
        h *= 2
    return y.view(x.shape)


def rotate(x_ND: torch.Tensor, s_ND: torch.Tensor) -> torch.Tensor:
    """z = R x: signs, then the blockwise normalised Hadamard transform."""
    N, d = x_ND.shape
    n = block_size(d)
    return fwht((x_ND * s_ND).view(N, d // n, n)).view(N, d) / math.sqrt(n)


def unrotate(z_ND: torch.Tensor, s_ND: torch.Tensor) -> torch.Tensor:
    """x = Rᵀ z (H is symmetric and H·H = n·I)."""
    N, d = z_ND.shape
    n = block_size(d)
    return fwht(z_ND.view(N, d // n, n)).view(N, d) / math.sqrt(n) * s_ND


def dither(keys_N: torch.Tensor, m: int, direction: str) -> torch.Tensor:
    """u (N, m) in [0, 1), exact in fp32 (24-bit numerators)."""
    words = mix32(_tagged(keys_N, DITHER[direction])[:, None] ^ torch.arange(m, device=keys_N.device))
    return (words >> 8).float() / 2 ** 24


def fp16_ceil(a: torch.Tensor) -> torch.Tensor:
    """The smallest fp16 ≥ a (a ≥ 0, fp32)."""
    h = a.half()
    return torch.where(h.float() < a, torch.nextafter(h, torch.full_like(h, float("inf"))), h)


def pack(q_NM: torch.Tensor, bits: int) -> torch.Tensor:
    """b-bit fields, LSB first → (N, ⌈m·b/8⌉) uint8."""
    N, m = q_NM.shape
    if 8 % bits == 0:     # whole fields per byte: the same bytes as the bit stream below, 8/b at a time
        per = 8 // bits
        fields = torch.nn.functional.pad(q_NM, (0, (-m) % per)).view(N, -1, per)
        return (fields << torch.arange(0, 8, bits, device=q_NM.device)).sum(-1).to(torch.uint8)
    stream = ((q_NM[:, :, None] >> torch.arange(bits, device=q_NM.device)) & 1).reshape(N, m * bits)
    stream = torch.nn.functional.pad(stream, (0, (-m * bits) % 8)).view(N, -1, 8)
    return (stream << torch.arange(8, device=q_NM.device)).sum(-1).to(torch.uint8)


def unpack(b_NB: torch.Tensor, m: int, bits: int) -> torch.Tensor:
    N, dev = b_NB.shape[0], b_NB.device
    if 8 % bits == 0:
        return ((b_NB.long()[:, :, None] >> torch.arange(0, 8, bits, device=dev)) & (2 ** bits - 1)).view(N, -1)[:, :m]
    stream = ((b_NB.long()[:, :, None] >> torch.arange(8, device=dev)) & 1).reshape(N, -1)[:, :m * bits]
    return (stream.view(N, m, bits) << torch.arange(bits, device=dev)).sum(-1)


def tile_scale(a_N1: torch.Tensor, r_NT: torch.Tensor, m: int, tile: int) -> torch.Tensor:
    """Per-coordinate scales (N, m) from the token's fp32 scale a and the tiles' r (N, ⌈m/t⌉);
    tile 0: a itself."""
    if not tile:
        return a_N1.expand(-1, m)
    return (a_N1 * r_NT.float() / 255).repeat_interleave(tile, -1)[:, :m]


def _tiles(zs_NM: torch.Tensor, tile: int) -> torch.Tensor:
    """(N, m) → (N, ⌈m/t⌉, t), the last tile padded with zeros (which change neither its max nor its
    sum of squares; the RMS divides by t, so a short last tile reads a little small)."""
    N, m = zs_NM.shape
    return torch.nn.functional.pad(zs_NM, (0, (-m) % tile)).view(N, -1, tile)


def tile_ratios(zs_NM: torch.Tensor, a_N1: torch.Tensor, tile: int) -> torch.Tensor:
    """r (N, ⌈m/t⌉) int64: per tile the smallest r in [0, 255] whose scale covers the tile's max."""
    peak = _tiles(zs_NM.abs(), tile).amax(-1)
    safe_a = torch.where(a_N1 > 0, a_N1, torch.ones_like(a_N1))
    r = torch.ceil(peak * 255 / safe_a).clamp_(0, 255)
    r = torch.where(a_N1 * r / 255 < peak, r + 1, r).clamp_(0, 255)   # fp32 rounding of a·r/255
    return r.long()


def gauss_levels(bits: int, device=None) -> torch.Tensor:
    half = torch.tensor(LLOYD_MAX[bits]).to(device)
    return torch.cat([-half.flip(0), half])


def gauss_encode(zs_NM: torch.Tensor, budget: Budget) -> torch.Tensor:
    """The Gaussian-levels code of the kept coordinates (N, m) → (N, bytes) uint8."""
    m = zs_NM.shape[1]
    rms = _tiles(zs_NM, budget.tile).pow(2).mean(-1).sqrt()
    a = fp16_ceil(rms.amax(-1))                                                  # (N,) fp16
    af = a.float()[:, None]
    r = torch.round(rms * 255 / torch.where(af > 0, af, torch.ones_like(af))).clamp_(0, 255).long()
    s = tile_scale(af, r, m, budget.tile)
    c = gauss_levels(budget.bits, zs_NM.device)
    q = torch.bucketize(torch.where(s > 0, zs_NM / s, torch.zeros_like(s)), (c[1:] + c[:-1]) / 2)
    return torch.cat([a.view(-1, 1).view(torch.uint8), r.to(torch.uint8), pack(q, budget.bits)], dim=-1)


def encode(x_ND: torch.Tensor, keys_N: torch.Tensor, budget: Budget, direction: str) -> torch.Tensor:
    """x (N, d) → code (N, budget.bytes_per_token) uint8."""
    z = rotate(x_ND.float(), signs(keys_N, budget.d))
    zs = z.gather(-1, kept_channels(_tagged(keys_N, SUBSET), budget.d, budget.m))
    if budget.levels == "gauss":
        return gauss_encode(zs, budget)
    a = fp16_ceil(zs.abs().amax(-1))                                             # (N,) fp16
    r = tile_ratios(zs, a.float()[:, None], budget.tile) if budget.tile else zs.new_zeros(zs.shape[0], 0).long()
    af = tile_scale(a.float()[:, None], r, budget.m, budget.tile)                # (N, m)
    levels = 2 ** budget.bits - 1
    delta = torch.where(af > 0, 2 * af / levels, torch.ones_like(af))
    q = torch.round((zs + af) / delta + dither(keys_N, budget.m, direction) - 0.5).clamp_(0, levels).long()
    return torch.cat([a.view(-1, 1).view(torch.uint8), r.to(torch.uint8), pack(q, budget.bits)], dim=-1)


def decode(code_NB: torch.Tensor, keys_N: torch.Tensor, budget: Budget, direction: str,
           dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """code (N, bytes) → x̂ (N, d), unbiased for the x that was encoded."""
    a = code_NB[:, :SCALE_BYTES].contiguous().view(torch.half).float()          # (N, 1)
    head = SCALE_BYTES + budget.tiles
    af = tile_scale(a, code_NB[:, SCALE_BYTES:head].long(), budget.m, budget.tile)   # (N, m)
    if budget.levels == "gauss":
        zs = gauss_levels(budget.bits, code_NB.device)[unpack(code_NB[:, head:], budget.m, budget.bits)] * af
    else:
        levels = 2 ** budget.bits - 1
        q = unpack(code_NB[:, head:], budget.m, budget.bits).float()
        zs = (q - dither(keys_N, budget.m, direction) + 0.5) * (2 * af / levels) - af
        zs = torch.where(af > 0, zs, torch.zeros_like(zs))
    z = torch.zeros(code_NB.shape[0], budget.d, device=code_NB.device).scatter_(-1, kept_channels(_tagged(keys_N, SUBSET), budget.d, budget.m),
                                                          zs * (budget.d / budget.m))
    return unrotate(z, signs(keys_N, budget.d)).to(dtype)
