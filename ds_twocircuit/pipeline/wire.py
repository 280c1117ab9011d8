"""The wire accounting: bytes this rank hands to DeepSpeed's p2p layer, by direction.

Counts everything the pipeline sends between stages: payloads, gradients, side tensors and shape
metadata (the engine calls `p2p.send` through the module, so wrapping the module function sees
every send). Sends to a later stage are forward, to an earlier one backward. Only sends inside a
`counting()` block are counted, so each pass's bytes are its own:

    with wire.counting() as w:  ...passes...      → w.fwd, w.bwd (w.fwd_fp32, w.bwd_fp32)

The fp32 share is counted apart: a bf16 pipeline sends those tensors (dense activations, their
gradients, a PRF payload) at half the size and everything else (b-bit codes, integer metadata) as it
is, so `fwd - fwd_fp32 / 2` is what the same sends cost in bf16, from the real counts.
"""
import contextlib
from dataclasses import dataclass

import torch


@dataclass
class WireCount:
    fwd: int = 0
    bwd: int = 0
    fwd_fp32: int = 0
    bwd_fp32: int = 0


class WireCounter:
    def __init__(self, stage_id: int):
        from deepspeed.runtime.pipe import p2p
        self.stage_id, self._count = stage_id, None
        inner = getattr(p2p.send, "__wrapped__", p2p.send)

        def send(tensor, dest_stage, async_op=False):
            if self._count is not None:
                n = tensor.numel() * tensor.element_size()
                n32 = n if tensor.dtype == torch.float32 else 0
                if dest_stage > self.stage_id:
                    self._count.fwd += n
                    self._count.fwd_fp32 += n32
                else:
                    self._count.bwd += n
                    self._count.bwd_fp32 += n32
            return inner(tensor, dest_stage, async_op=async_op)

        send.__wrapped__ = inner
        p2p.send = send

    @contextlib.contextmanager
    def counting(self):
        assert self._count is None, "wire counts do not nest"
        self._count = WireCount()
        try:
            yield self._count
        finally:
            self._count = None
