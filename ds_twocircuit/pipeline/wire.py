"""The one hook on DeepSpeed's pipeline p2p layer: every tensor a stage sends to or receives from
another stage passes through it (the engine calls `p2p.send` and `p2p.recv` through the module, so
wrapping the module functions sees all of them: payloads, gradients, side tensors, shape metadata;
the loss's broadcast and the tied gradients' all-reduce are collectives, not p2p). It does three
things, all at the transport:

counting   bytes this rank hands to `p2p.send`, by direction (to a later stage: forward, to an
           earlier one: backward), only inside a `counting()` block, so each pass's bytes are its own:

               with wire.counting() as w:  ...passes...   → w.fwd, w.bwd (w.fwd_fp32, w.bwd_fp32)

           The fp32 share is counted apart: a bf16 pipeline sends those tensors (dense activations,
           their gradients, a PRF payload) at half the size and everything else (b-bit codes,
           integer metadata) as it is, so `fwd - fwd_fp32 / 2` is what the same sends cost in bf16.

the ledger every tensor received goes into traffic.py's ledger, under the kind of the pass
           running (`traffic.boundary(kind)`), from the sending stage's global rank.

strict     (`DS_TWOCIRCUIT_STRICT_WIRE=1`, set by the tests) each send is preceded by a 2-value
           header (dtype, element count) and each receive checks it against the buffer it receives
           into, failing with both ends' (dtype, numel). NCCL requires a send and its receive to agree
           in datatype and count and says nothing when they do not (a hang or corrupt values); gloo
           checks bytes only. The check makes that rule hold on CPU, where the suite runs. Headers
           are not counted, and a user's run sends none.

`install(stage_id)` wraps both functions once per process (build_pipeline calls it before any pass,
on every rank, so both ends of every send agree on the headers); `counting()` reads it.
"""
import contextlib
import os
from dataclasses import dataclass

import torch

from . import traffic

STRICT_ENV = "DS_TWOCIRCUIT_STRICT_WIRE"
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.uint8, torch.int8, torch.int16,
           torch.int32, torch.int64, torch.bool]


@dataclass
class WireCount:
    fwd: int = 0
    bwd: int = 0
    fwd_fp32: int = 0
    bwd_fp32: int = 0


class WireMismatch(RuntimeError):
    """A receive whose buffer differs in dtype or element count from what the other end sent."""


@dataclass
class _Tap:
    stage_id: int
    strict: bool
    count: WireCount | None = None


_TAP: _Tap | None = None


def _header(t: torch.Tensor) -> torch.Tensor:
    return torch.tensor([_DTYPES.index(t.dtype), t.numel()], dtype=torch.int64, device=t.device)


def _add(count: WireCount, t: torch.Tensor, forward: bool) -> None:
    n = t.numel() * t.element_size()
    n32 = n if t.dtype == torch.float32 else 0
    if forward:
        count.fwd += n
        count.fwd_fp32 += n32
    else:
        count.bwd += n
        count.bwd_fp32 += n32


def install(stage_id: int, strict: bool | None = None) -> None:
    """Wrap `p2p.send` and `p2p.recv` (once per process; a later call only updates the stage).
    `strict` None: from DS_TWOCIRCUIT_STRICT_WIRE."""
    global _TAP
    from deepspeed.runtime.pipe import p2p
    if strict is None:
        strict = os.environ.get(STRICT_ENV, "0") not in ("", "0")
    if _TAP is not None:
        assert _TAP.strict == strict, "the wire's strict check is set once per process"
        _TAP.stage_id = stage_id
        return
    _TAP = tap = _Tap(stage_id, strict)
    send0, recv0 = (getattr(f, "__wrapped__", f) for f in (p2p.send, p2p.recv))

    def send(tensor, dest_stage, async_op=False):
        if tap.count is not None:
            _add(tap.count, tensor, dest_stage > tap.stage_id)
        if tap.strict:
            send0(_header(tensor), dest_stage, async_op=async_op)
        return send0(tensor, dest_stage, async_op=async_op)

    def recv(tensor, src_stage, async_op=False):
        if tap.strict:
            head = torch.empty(2, dtype=torch.int64, device=tensor.device)
            recv0(head, src_stage, async_op=async_op)
            sent = (_DTYPES[int(head[0])], int(head[1]))
            if sent != (tensor.dtype, tensor.numel()):
                raise WireMismatch(f"stage {tap.stage_id} receives from stage {src_stage} into a {tensor.dtype} "
                                   f"buffer of {tensor.numel()} elements what was sent as {sent[0]} × {sent[1]}")
        traffic.received(traffic.boundary_kind(), p2p._grid.stage_to_global(stage_id=src_stage),
                         traffic.tensor_bytes(tensor))
        return recv0(tensor, src_stage, async_op=async_op)

    send.__wrapped__, recv.__wrapped__ = send0, recv0
    p2p.send, p2p.recv = send, recv


def count_tied_grads(engine) -> None:
    """Put DeepSpeed's all-reduce of the tied weights' gradients between their stages (the embedding
    and the head) in the ledger. The engine asks its module for the (weight, group) pairs right before
    reducing each one's gradient (`_exec_reduce_tied_grads`: `_hp_grad`, fp32, under the bf16
    optimizer, else `.grad`), so wrapping that call sees every reduction. A ring all-reduce of n bytes
    over g ranks has each rank receive 2n(g − 1)/g, attributed evenly to the other members (n from
    the other end of a pair, the tied weights' case). Inside the probe it is the probe's."""
    import torch.distributed as dist
    module, me = engine.module, dist.get_rank()
    pairs0 = module.get_tied_weights_and_groups

    def pairs():
        out = pairs0()
        kind = "boundary_probe" if traffic.boundary_kind() == "boundary_probe" else "tied_grads"
        for weight, group in out:
            grad = weight._hp_grad if engine.using_bf16_optimizer else weight.grad
            ranks = dist.get_process_group_ranks(group)
            for r in (r for r in ranks if r != me) if grad is not None else ():
                traffic.received(kind, r, 2 * traffic.tensor_bytes(grad) // len(ranks))
        return out

    module.get_tied_weights_and_groups = pairs


@contextlib.contextmanager
def counting():
    """Count the sends inside the block → the WireCount, filled as they run."""
    assert _TAP is not None, "wire.install was not called (pipeline/engine.py build_pipeline)"
    assert _TAP.count is None, "wire counts do not nest"
    _TAP.count = WireCount()
    try:
        yield _TAP.count
    finally:
        _TAP.count = None
