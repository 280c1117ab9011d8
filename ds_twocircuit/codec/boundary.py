"""Encode/decode at a pipeline cut: what crosses the wire is k values per token, never the mask.

The last decoder layer of stage s encodes its output, the first decoder layer of stage s+1
decodes its input; DeepSpeed only ever sees the small tensor, forward and backward (autograd of a
scatter is a gather, so the gradient sent back is (B, T, k) too).

    prf:      y_BTk = x_BTD[..., K] (K = prf.kept_for(...), both ends),  x̂ = scatter(y) · d/k
              E[x̂] = x: each channel is kept with probability k/d.
    lowrank:  y_BTk = x_BTD Q_Dk,  x̂ = y Qᵀ   (Q orthonormal, one per cut, the same at both ends)
    dense:    x itself (the byte-matched control).

`CodecState` is the per-process context every cut reads: the codec, k, the step the masks are
keyed by (set before every pass of an iteration), an on/off switch (the codec-off probe), the
lowrank bases, and the payload byte counters used for the wire accounting.
"""
from dataclasses import dataclass, field

import torch

from . import prf

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class CodecState:
    name: str = "dense"                 # dense | prf | lowrank
    d: int = 0
    k: int = 0
    seed: int = 0
    cuts: frozenset = frozenset()       # decoder layer indices after which a compressed cut sits
    payload_dtype: torch.dtype = torch.float32
    step: int = 0
    enabled: bool = True
    bases: dict = field(default_factory=dict)          # cut layer → Q_Dk (lowrank)
    payload_bytes: int = 0                              # bytes of encoded payloads produced (fwd)
    dense_payload_bytes: int = 0                        # what the dense activations would have been
    recording: dict | None = None                       # cut layer → list of dense x (basis calibration)

    def active(self, layer: int) -> bool:
        return self.enabled and self.name != "dense" and layer in self.cuts

    def encode(self, x_BTD, pos_BT, sid_B, layer: int):
        if self.recording is not None and layer in self.cuts:
            self.recording.setdefault(layer, []).append(x_BTD.detach().reshape(-1, x_BTD.shape[-1]))
        if not self.active(layer):
            return x_BTD
        if self.name == "prf":
            y = x_BTD.gather(-1, prf.kept_for(self.seed, layer, self.step, sid_B, pos_BT, self.d, self.k))
        else:
            y = x_BTD @ self.bases[layer].to(x_BTD.dtype)
        y = y.to(self.payload_dtype)
        self.payload_bytes += y.numel() * y.element_size()
        self.dense_payload_bytes += x_BTD.numel() * x_BTD.element_size()
        return y

    def decode(self, y_BTk, pos_BT, sid_B, layer: int, dtype: torch.dtype):
        if not self.active(layer):
            return y_BTk
        y = y_BTk.to(dtype)
        if self.name == "prf":
            idx = prf.kept_for(self.seed, layer, self.step, sid_B, pos_BT, self.d, self.k)
            scaled = y * (self.d / self.k)   # scale the k kept values, not all d
            return torch.zeros(*y.shape[:-1], self.d, dtype=dtype, device=y.device).scatter(-1, idx, scaled)
        return y @ self.bases[layer].to(dtype).T

    def set_basis(self, layer: int, q_Dk: torch.Tensor) -> None:
        """Replace a lowrank cut's basis (the anchor refreshes them; both ends must set the same Q)."""
        if q_Dk.shape != (self.d, self.k):
            raise ValueError(f"basis for cut {layer}: shape {tuple(q_Dk.shape)}, expected ({self.d}, {self.k})")
        gram = q_Dk.double().T @ q_Dk.double()
        if not torch.allclose(gram, torch.eye(self.k, dtype=torch.float64), atol=1e-4):
            raise ValueError(f"basis for cut {layer} is not orthonormal")
        self.bases[layer] = q_Dk.float().contiguous()

    def take_counters(self) -> tuple[int, int]:
        out = (self.payload_bytes, self.dense_payload_bytes)
        self.payload_bytes = self.dense_payload_bytes = 0
        return out


def top_basis(x_ND: torch.Tensor, k: int) -> torch.Tensor:
    """Orthonormal Q (d, k): the top-k right singular vectors of the activations (PCA without centring)."""
    _, _, vh = torch.linalg.svd(x_ND.double(), full_matrices=False)
    return vh[:k].T.float().contiguous()


def cut_layers(layers_per_stage: list[int]) -> list[int]:
    """Decoder layer index after which each cut sits (boundary b is after stage b)."""
    out, acc = [], 0
    for n in layers_per_stage[:-1]:
        acc += n
        out.append(acc - 1)
    return out
