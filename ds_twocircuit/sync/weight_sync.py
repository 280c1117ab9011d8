"""The sampler's weight sync: every stage's weights to global rank 0 as lossless deltas in the
sampler's dtype (delta.py).

After every optimizer step each stage (its data-parallel replica 0) copies its parameters to the
host in the sampler's dtype, encodes the tensors' changes since its previous sync and sends the
blob to global rank 0 (pipeline/comm.py): a 16-byte header (blob length, elements changed) on the
control path, then the blob on the device path. Rank 0 rebuilds the whole model's sampler-dtype weights (`mirror`: bitwise the trainer's
weights rounded to that dtype) and names the tensors that changed, which the sampler takes in. The first sync
of a process sends every tensor whole. Rank 0's own stage never crosses a wire.

    sync/bytes         bytes rank 0 received (headers included): the wire from the stages' hosts
    sync/dense_bytes   the same tensors sent whole in the sampler's dtype over that wire
    sync/changed_frac  elements whose sampler-dtype value changed, over all the model's elements

None of this goes through DeepSpeed's p2p layer, so none of it counts as boundary traffic.

Test hook: `DS_TWOCIRCUIT_DUMP_SAMPLER=DIR` makes rank 0 write, at the end of the run, the mirror
(`mirror.safetensors`) and the weights the sampler itself reports holding (`held.safetensors`; the
HF backend's own parameters, none for vLLM, whose CPU kernels repack linear weights).
Benchmark hook: `DS_TWOCIRCUIT_DUMP_STREAM=DIR` makes rank 0 write the mirror after every sync
(`sync{n}.safetensors`, n = 0 the start) for launch/bench_stream.py.
"""
import os
import pathlib

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from ..pipeline import comm
from .delta import DeltaStats, changed_mask, decode_all, encode_all, unchanged


class WeightSync:
    def __init__(self, grid, pipe, dtype: torch.dtype, shapes: dict | None):
        """`shapes`: HF name → (shape, dtype) of the sampler's whole model, on rank 0; None elsewhere."""
        self.grid, self.pipe, self.dtype, self.shapes = grid, pipe, dtype, shapes
        self.names = pipe.hf_names_per_stage()
        self.sent: list[torch.Tensor] | None = None        # this stage's values at its last sync
        self.mirror: dict[str, torch.Tensor] = {}            # rank 0: the sampler's weights, every stage
        self.elt = torch.empty((), dtype=dtype).element_size()

    def __call__(self) -> tuple[set[str] | None, dict]:
        """One sync → (on rank 0: the names of the tensors that changed, the sync's metrics; `mirror`
        holds the new values), (None, {}) elsewhere."""
        if self.grid.get_data_parallel_rank() != 0:
            return None, {}
        mine = self.pipe.hf_parameters()
        # the deltas are coded on the host: one copy of the stage in the sampler's dtype
        own = [mine[n].detach().to("cpu", self.dtype, copy=True) for n in self.names[self.pipe.stage_id]]
        if dist.get_rank() != 0:
            blob, stats = encode_all(self.sent or [None] * len(own), own)
            comm.send_bytes(blob, 0, [stats.changed])
            self.sent = own
            return None, {}
        changed, own_changed = self._own(own)
        wire = DeltaStats()
        for s in range(1, self.pipe.num_stages):
            got, stats = self._receive(s)
            changed.update(got)
            wire += stats
        total = sum(t.numel() for t in self.mirror.values())
        dump_stream(self.mirror)
        return set(changed), {"sync/bytes": float(wire.nbytes), "sync/dense_bytes": float(wire.dense_bytes),
                         "sync/changed_frac": (wire.changed + own_changed) / max(total, 1)}

    def _own(self, own: list[torch.Tensor]) -> tuple[dict[str, torch.Tensor], int]:
        """Rank 0's stage into the mirror; → (the tensors that changed, elements changed)."""
        out, count = {}, 0
        for n, t in zip(self.names[0], own):
            old = self.mirror.get(n)
            m = t.numel() if old is None else int(changed_mask(old, t).sum())
            if m:
                self.mirror[n] = out[n] = t
            count += m
        return out, count

    def _receive(self, stage: int) -> tuple[dict[str, torch.Tensor], DeltaStats]:
        """Stage `stage`'s blob into the mirror; → (the tensors that changed, the wire's stats)."""
        blob, (changed,) = comm.recv_bytes(self.grid.stage_to_global(stage_id=stage, data=0), 1, kind="stream")
        names = self.names[stage]
        news = decode_all([self.mirror.get(n) for n in names], blob, [tuple(self.shapes[n][0]) for n in names],
                          self.dtype)
        out = {}
        for n, t, same in zip(names, news, unchanged(blob)):
            if not same:
                self.mirror[n] = out[n] = t
        numel = sum(t.numel() for t in news)
        return out, DeltaStats(changed, numel, 16 + len(blob), numel * self.elt)


def dump_stream(mirror: dict[str, torch.Tensor]) -> None:
    """The benchmark hook of the module docstring (rank 0, after each sync)."""
    out = os.environ.get("DS_TWOCIRCUIT_DUMP_STREAM")
    if not out:
        return
    d = pathlib.Path(out)
    d.mkdir(parents=True, exist_ok=True)
    n = len(list(d.glob("sync*.safetensors")))
    save_file({k: t.contiguous() for k, t in mirror.items()}, str(d / f"sync{n}.safetensors"))


def dump_for_tests(mirror: dict[str, torch.Tensor], sampler) -> None:
    """The test hook of the module docstring (rank 0, at the end of a run)."""
    out = os.environ.get("DS_TWOCIRCUIT_DUMP_SAMPLER")
    if not out:
        return
    pathlib.Path(out).mkdir(parents=True, exist_ok=True)
    save_file({n: t.contiguous() for n, t in mirror.items()}, str(pathlib.Path(out) / "mirror.safetensors"))
    held = sampler.held_weights()
    if held is not None:
        save_file({n: t.detach().cpu().contiguous() for n, t in held.items()}, str(pathlib.Path(out) / "held.safetensors"))
