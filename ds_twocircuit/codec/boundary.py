"""Encode/decode at a pipeline cut: what crosses the wire is k values per token, never the mask.

The last decoder layer of stage s encodes its output, the first decoder layer of stage s+1
decodes its input; DeepSpeed only ever sees the small tensor, forward and backward (autograd of a
scatter is a gather, so the gradient sent back is (B, T, k) too).

    prf:      y_BTk = x_BTD[..., K] (K = prf.kept_for(...), both ends),  x̂ = scatter(y) · d/k
              E[x̂] = x: each channel is kept with probability k/d.
    lowrank:  y_BTk = x_BTD Q_Dk,  x̂ = y Qᵀ   (Q orthonormal, one per cut, the same at both ends)
    dense:    x itself (the byte-matched control).

`Codec` is what every cut of a process reads: its geometry (name, d, k, seed, cuts, payload dtype)
and the lowrank bases, plus three settings that hold only inside a block, so a pass never leaves
them behind for the next one:

    with codec.keyed(step):        the PRF masks of every pass inside are keyed by `step`
    with codec.off():              every cut inside is the identity (dense steps, the probe)
    with codec.counting() as n:    n.payload, n.dense: bytes of the payloads encoded inside, and
                                   what the same activations weigh dense (the wire accounting)
"""
import contextlib
from dataclasses import dataclass

import torch

from . import prf
from .geometry import compressed_cuts, keep_count
from .lowrank import checked_basis

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class PayloadCount:
    payload: int = 0      # bytes of the encoded payloads (forward)
    dense: int = 0        # bytes the same activations have uncompressed


class Codec:
    def __init__(self, name: str = "dense", d: int = 0, k: int = 0, seed: int = 0, cuts=frozenset(),
                 payload_dtype: torch.dtype = torch.float32):
        self.name, self.d, self.k, self.seed = name, d, k, seed
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

    # ---- the cut ----------------------------------------------------------------------------
    def encode(self, x_BTD, pos_BT, sid_B, layer: int):
        if not self.active(layer):
            return x_BTD
        if self.name == "prf":
            y = x_BTD.gather(-1, prf.kept_for(self.seed, layer, self._step, sid_B, pos_BT, self.d, self.k))
        else:
            y = x_BTD @ self.bases[layer].to(x_BTD.dtype)
        y = y.to(self.payload_dtype)
        if self._count is not None:
            self._count.payload += y.numel() * y.element_size()
            self._count.dense += x_BTD.numel() * x_BTD.element_size()
        return y

    def decode(self, y_BTk, pos_BT, sid_B, layer: int, dtype: torch.dtype):
        if not self.active(layer):
            return y_BTk
        y = y_BTk.to(dtype)
        if self.name == "prf":
            idx = prf.kept_for(self.seed, layer, self._step, sid_B, pos_BT, self.d, self.k)
            scaled = y * (self.d / self.k)   # scale the k kept values, not all d
            return torch.zeros(*y.shape[:-1], self.d, dtype=dtype, device=y.device).scatter(-1, idx, scaled)
        return y @ self.bases[layer].to(dtype).T

    def set_bases(self, bases: dict[int, torch.Tensor]) -> None:
        """Replace lowrank cuts' bases (cut layer → Q); both ends of a cut must set the same Q."""
        for layer, q in bases.items():
            self.bases[layer] = checked_basis(q, self.d, self.k, layer)


def build_codec(c, d: int, layers_per_stage: list[int]) -> Codec:
    """The run's codec from its `codec.*` config block, for a model of hidden size d."""
    return Codec(name=c.name, d=d, k=keep_count(c.keep, c.keep_ratio, d), seed=c.seed,
                 cuts=compressed_cuts(c.boundaries, layers_per_stage), payload_dtype=DTYPES[c.payload_dtype])
