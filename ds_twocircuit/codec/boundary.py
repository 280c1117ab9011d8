"""Encode/decode at a pipeline cut: what crosses the wire is k values per token, never the mask.

The last decoder layer of stage s encodes its output, the first decoder layer of stage s+1
decodes its input; DeepSpeed only ever sees the small tensor, forward and backward (autograd of a
scatter is a gather, so the gradient sent back is (B, T, k) too).

    prf:      y_BTk = x_BTD[..., K] (K = prf.kept_for(...), both ends),  x̂ = scatter(y) · d/k
              E[x̂] = x: each channel is kept with probability k/d.
    lowrank:  y_BTk = x_BTD Q_Dk,  x̂ = y Qᵀ   (Q orthonormal, one per cut, the same at both ends)
    rotated:  the rotated, dithered low-bit code of rotated.py, with its own budget per direction:
              (carrier fp16 (B, T, G/2), payload uint8 (B, T, F − G)) cross the cut, F forward
              bytes per token; the carrier's gradient is the G-byte backward code (wire_format):
              the rotated code of each token's gradient, or with `bwd_rank` = r the micro-batch's
              rank-r code (rank_code.py)
    dense:    x itself (the byte-matched control).

What crosses a cut is `wire_out(x)`: a tuple of tensors, floats first (DeepSpeed sends a gradient
back for every float it receives, shaped like it, and matches its buffers by position).

`Codec` is what every cut of a process reads: its geometry (name, d, k, seed, cuts, payload dtype)
and the lowrank bases, plus three settings that hold only inside a block, so a pass never leaves
them behind for the next one:

    with codec.keyed(step):        the PRF masks of every pass inside are keyed by `step`
    with codec.off():              every cut inside is the identity (dense steps, the probe)
    with codec.counting() as n:    n.payload, n.dense, n.grad: bytes of the payloads encoded inside,
                                   what the same activations weigh dense, and what their gradients
                                   carry back (the wire accounting); an activation checkpoint's
                                   recompute, which runs inside the backward and sends nothing, is
                                   not counted
"""
import contextlib
import math
from dataclasses import dataclass

import torch

from . import prf, rank_code, rotated
from .geometry import compressed_cuts, keep_count
from .lowrank import checked_basis

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class PayloadCount:
    payload: int = 0      # bytes of the encoded payloads (forward)
    dense: int = 0        # bytes the same activations have uncompressed
    grad: int = 0         # bytes their gradients carry back (the payload's, or the rotated carrier's)


class Codec:
    def __init__(self, name: str = "dense", d: int = 0, k: int = 0, seed: int = 0, cuts=frozenset(),
                 payload_dtype: torch.dtype = torch.float32, fwd: rotated.Budget | None = None,
                 bwd: rotated.Budget | None = None, bwd_rank: int = 0):
        self.name, self.d, self.k, self.seed = name, d, k, seed
        self.fwd, self.bwd = fwd, bwd            # rotated: the budget of each direction
        self.bwd_rank = bwd_rank                 # rotated: > 0 codes the backward at this rank instead
        self.cuts = frozenset(cuts)          # decoder layer indices after which a compressed cut sits
        self.payload_dtype = payload_dtype
        self.bases: dict[int, torch.Tensor] = {}   # cut layer → Q_Dk (lowrank)
        self._step, self._on, self._count = 0, True, None

    # ---- scoped settings --------------------------------------------------------------------
    @contextlib.contextmanager
    def keyed(self, step: int):
        prev, self._step = self._step, step
        try:
            yield self
        finally:
            self._step = prev

    @contextlib.contextmanager
    def off(self):
        prev, self._on = self._on, False
        try:
            yield self
        finally:
            self._on = prev

    @contextlib.contextmanager
    def counting(self):
        assert self._count is None, "payload counts do not nest"
        self._count = PayloadCount()
        try:
            yield self._count
        finally:
            self._count = None

    @property
    def on(self) -> bool:
        return self._on

    def active(self, layer: int) -> bool:
        return self._on and self.name != "dense" and layer in self.cuts

    def _counted(self) -> PayloadCount | None:
        """The open count, unless this is a recompute: autograd is running a backward (the graph task
        id is -1 outside one; torch.utils.checkpoint reads it the same way)."""
        return self._count if torch._C._current_graph_task_id() == -1 else None

    # ---- the cut ----------------------------------------------------------------------------
    def _keys(self, pos_BT, sid_B, layer: int):
        """(B, T) int64 per-token PRF keys of this step and cut: a token's own, whatever its batch."""
        return prf.token_keys(self.seed, layer, self._step, sid_B[:, None], pos_BT)

    def encode(self, x_BTD, pos_BT, sid_B, layer: int):
        if not self.active(layer):
            return x_BTD
        if self.name == "prf":
            y = x_BTD.gather(-1, prf.kept_for(self.seed, layer, self._step, sid_B, pos_BT, self.d, self.k))
        elif self.name == "rotated":   # the forward code alone (inference); training sends wire_out's
            keys = self._keys(pos_BT, sid_B, layer)
            y = rotated.encode(x_BTD.reshape(-1, self.d), keys.reshape(-1), self.fwd, "fwd").view(*pos_BT.shape, -1)
            return y
        else:
            y = x_BTD @ self.bases[layer].to(x_BTD.dtype)
        y = y.to(self.payload_dtype)
        if (n := self._counted()) is not None:
            n.payload += y.numel() * y.element_size()
            n.grad += y.numel() * y.element_size()
            n.dense += x_BTD.numel() * x_BTD.element_size()
        return y

    def decode(self, y_BTk, pos_BT, sid_B, layer: int, dtype: torch.dtype):
        if not self.active(layer):
            return y_BTk
        if self.name == "rotated":
            keys = self._keys(pos_BT, sid_B, layer)
            return rotated.decode(y_BTk.reshape(keys.numel(), -1), keys.reshape(-1), self.fwd, "fwd",
                                  dtype).view(*pos_BT.shape, -1)
        y = y_BTk.to(dtype)
        if self.name == "prf":
            idx = prf.kept_for(self.seed, layer, self._step, sid_B, pos_BT, self.d, self.k)
            scaled = y * (self.d / self.k)   # scale the k kept values, not all d
            return torch.zeros(*y.shape[:-1], self.d, dtype=dtype, device=y.device).scatter(-1, idx, scaled)
        return y @ self.bases[layer].to(dtype).T

    # ---- what crosses the wire ----------------------------------------------------------------
    def wire_out(self, x_BTD, pos_BT, sid_B, layer: int) -> tuple:
        """The sender's side of a cut: the tensors DeepSpeed sends (floats first)."""
        if self.name != "rotated" or not self.active(layer):
            return (self.encode(x_BTD, pos_BT, sid_B, layer),)
        keys = self._keys(pos_BT, sid_B, layer)
        carrier, payload = _RotatedSend.apply(x_BTD, keys, self.fwd, self.back())
        if (n := self._counted()) is not None:
            n.payload += carrier.numel() * 2 + payload.numel()
            n.grad += carrier.numel() * 2
            n.dense += x_BTD.numel() * x_BTD.element_size()
        return (carrier, payload) if payload.shape[-1] else (carrier,)

    def wire_in(self, wire: tuple, pos_BT, sid_B, layer: int, dtype: torch.dtype):
        """The receiver's side: the decoded hidden state (B, T, d)."""
        if self.name != "rotated" or not self.active(layer):
            return self.decode(wire[0], pos_BT, sid_B, layer, dtype)
        keys = self._keys(pos_BT, sid_B, layer)
        payload = wire[1] if len(wire) > 1 else wire[0].new_empty(*wire[0].shape[:-1], 0, dtype=torch.uint8)
        return _RotatedReceive.apply(wire[0], payload, keys, self.fwd, self.back(), dtype)

    def token_bytes(self, layer: int, act_bytes: int, backward: bool, tokens: int) -> int:
        """Bytes one token slot costs on cut `layer` as configured (on, whatever block this runs in):
        forward, plus its gradient back when the pass has a backward. `act_bytes`: the pipeline's
        activation element size (dense cuts); `tokens`: a micro-batch's slots (the rank code's share
        of its Q factor depends on it)."""
        if self.name == "dense" or layer not in self.cuts:
            return self.d * act_bytes * (1 + backward)
        if self.name == "rotated":
            f, g = wire_format(self.fwd, self.back(), tokens)
            return f + g * backward
        return self.k * self.payload_dtype.itemsize * (1 + backward)

    def back(self) -> "rotated.Budget | Rank":
        """The backward's code: the rotated budget, or the rank of the micro-batch's code."""
        return Rank(self.d, self.bwd_rank) if self.bwd_rank else self.bwd

    def set_bases(self, bases: dict[int, torch.Tensor]) -> None:
        """Replace lowrank cuts' bases (cut layer → Q); both ends of a cut must set the same Q."""
        for layer, q in bases.items():
            self.bases[layer] = checked_basis(q, self.d, self.k, layer)


@dataclass(frozen=True)
class Rank:
    """The backward's rank-r code of a micro-batch (rank_code.py) at width d."""
    d: int
    r: int


def wire_format(fwd: rotated.Budget, bwd: "rotated.Budget | Rank", tokens: int = 1) -> tuple[int, int]:
    """(F, G): bytes per token slot forward (all tensors of the cut) and backward (the carrier), for a
    micro-batch of `tokens` slots (the rank code's share of its Q factor depends on it). G is the
    backward code rounded up to whole fp16 values; the forward carries at least G bytes, since the
    carrier crosses in both directions."""
    if isinstance(bwd, Rank):
        g = 2 * rank_code.slots(tokens, bwd.d, bwd.r)
    else:
        g = 2 * math.ceil(bwd.bytes_per_token / 2)
    return max(fwd.bytes_per_token, g), g


def _encode_back(g_ND: torch.Tensor, keys_N: torch.Tensor, bwd) -> torch.Tensor:
    if isinstance(bwd, Rank):
        return rank_code.encode(g_ND, bwd.r, int(keys_N[0]))
    return rotated.encode(g_ND, keys_N, bwd, "bwd")


def _decode_back(code_NB: torch.Tensor, keys_N: torch.Tensor, bwd) -> torch.Tensor:
    if isinstance(bwd, Rank):
        return rank_code.decode(code_NB, bwd.d, bwd.r)
    return rotated.decode(code_NB[:, :bwd.bytes_per_token], keys_N, bwd, "bwd")


class _RotatedSend(torch.autograd.Function):
    """x (B, T, d) → the forward code split into (carrier fp16 (B, T, G/2), payload uint8 (B, T, F−G));
    backward: the carrier's gradient holds the receiver's backward code, decoded here to ∂x."""

    @staticmethod
    def forward(ctx, x, keys_BT, fwd, bwd):
        B, T, d = x.shape
        F, G = wire_format(fwd, bwd, B * T)
        code = torch.zeros(B * T, F, dtype=torch.uint8, device=x.device)
        code[:, :fwd.bytes_per_token] = rotated.encode(x.detach().reshape(-1, d), keys_BT.reshape(-1), fwd, "fwd")
        code = code.view(B, T, F)
        ctx.save_for_backward(keys_BT)
        ctx.bwd, ctx.x_dtype = bwd, x.dtype
        payload = code[..., G:].contiguous()
        ctx.mark_non_differentiable(payload)
        return code[..., :G].contiguous().view(torch.half), payload

    @staticmethod
    def backward(ctx, g_carrier, _):
        keys_BT, = ctx.saved_tensors
        B, T = keys_BT.shape
        code = g_carrier.contiguous().view(torch.uint8).reshape(B * T, -1)
        gx = _decode_back(code, keys_BT.reshape(-1), ctx.bwd).view(B, T, -1).to(ctx.x_dtype)
        return gx, None, None, None


class _RotatedReceive(torch.autograd.Function):
    """(carrier, payload) → x̂ (B, T, d); backward: ∂x̂ coded with the backward budget (fresh dither,
    coordinates within the forward's), returned as the carrier's gradient."""

    @staticmethod
    def forward(ctx, carrier, payload, keys_BT, fwd, bwd, dtype):
        B, T = keys_BT.shape
        code = torch.cat([carrier.contiguous().view(torch.uint8), payload], -1).reshape(B * T, -1)
        ctx.save_for_backward(keys_BT)
        ctx.bwd, ctx.carrier_shape = bwd, carrier.shape
        return rotated.decode(code[:, :fwd.bytes_per_token], keys_BT.reshape(-1), fwd, "fwd", dtype).view(B, T, -1)

    @staticmethod
    def backward(ctx, g):
        keys_BT, = ctx.saved_tensors
        B, T = keys_BT.shape
        code = torch.zeros(B * T, 2 * ctx.carrier_shape[-1], dtype=torch.uint8, device=g.device)
        back = _encode_back(g.reshape(B * T, -1).float(), keys_BT.reshape(-1), ctx.bwd)
        code[:, :back.shape[1]] = back
        return code.view(torch.half).view(ctx.carrier_shape), None, None, None, None, None


def build_codec(c, d: int, layers_per_stage: list[int]) -> Codec:
    """The run's codec from its `codec.*` config block, for a model of hidden size d."""
    budgets = {}
    if c.name == "rotated":
        budgets = {"fwd": rotated.Budget(d, c.fwd_coords or d, c.fwd_bits, c.fwd_tile, c.fwd_levels),
                   "bwd": rotated.Budget(d, c.bwd_coords or d, c.bwd_bits, c.bwd_tile)}
    return Codec(name=c.name, d=d, k=keep_count(c.keep, c.keep_ratio, d), seed=c.seed,
                 cuts=compressed_cuts(c.boundaries, layers_per_stage), payload_dtype=DTYPES[c.payload_dtype],
                 bwd_rank=c.bwd_rank if c.name == "rotated" else 0, **budgets)
