"""The trainer's control plane: every collective the project issues outside DeepSpeed's pipeline
schedule goes through this module, on one of two paths.

    control   small host data (flags, the fire choice, β, metric partials, shapes, byte counts):
              CPU tensors on a gloo group over the whole world, made beside DeepSpeed's groups
              by `init` (on a CPU machine the default group is gloo too; the separate group keeps
              one code path and lets the tests tell the paths apart)
    device    payloads (the rollout, the reference log-probs, weight deltas, sign bits, codec
              bases, the clip's norm): tensors on the accelerator's device, on the default group
              or DeepSpeed's, whose backend (NCCL on GPUs) takes them

NCCL refuses CPU tensors and gloo's p2p refuses CUDA ones, so a tensor's path is its device: the
control functions take and return CPU tensors, the device functions move what they are given to
`device()` and return tensors there (`host=True`: back on the CPU, for consumers that read them
there). A caller that names a `kind` has the receivers put what they received in the traffic ledger
(traffic.py): the rollout, the reference log-probs, the weight deltas, the signs.

Test hook: `DS_TWOCIRCUIT_RECORD_COLLECTIVES=DIR` makes `init` wrap torch.distributed's collectives
so that each process appends one JSON line per call to DIR/<pid>.jsonl: the op, the file that
called it (ours or DeepSpeed's), whether its group is the control path's, its backend, and its
tensors' devices; the first line holds this rank's device (tests/test_control_plane.py reads them).

`timeout` bounds every collective of both paths (`train.collective_timeout`): a rank waiting
longer than that for rank 0 (generating, scoring, evaluating, waiting for the anchor) fails with
an error that names the key (launch/train.py), where NCCL's watchdog would otherwise kill it.
"""
import datetime
import functools
import inspect
import json
import os
import pathlib
import pickle
import sys

import torch
import torch.distributed as dist

from . import traffic

_CONTROL = None     # the gloo group of the control path (every rank), made by init
_TIMEOUT = None     # train.collective_timeout, for the groups made later (subgroup)


def init(timeout_s: float) -> None:
    """The control path's gloo group (collective: every rank, after the default group)."""
    global _CONTROL, _TIMEOUT
    _TIMEOUT = datetime.timedelta(seconds=timeout_s)
    _CONTROL = dist.new_group(backend="gloo", timeout=_TIMEOUT)
    if os.environ.get("DS_TWOCIRCUIT_RECORD_COLLECTIVES"):
        _record_calls(pathlib.Path(os.environ["DS_TWOCIRCUIT_RECORD_COLLECTIVES"]))


def control_group():
    assert _CONTROL is not None, "comm.init was not called (pipeline/engine.py init_distributed)"
    return _CONTROL


def device() -> torch.device:
    """This rank's accelerator device (the CPU on a CPU machine)."""
    from deepspeed.accelerator import get_accelerator
    return torch.device(get_accelerator().current_device_name())


# ---- control path: CPU tensors, gloo ------------------------------------------------------------
def broadcast_scalar(value: float | int, dtype: torch.dtype, src: int = 0) -> float | int:
    """src's value on every rank (others pass anything)."""
    t = torch.tensor([value], dtype=dtype)
    dist.broadcast(t, src=src, group=control_group())
    return t.item()


def broadcast_object(obj, src: int = 0, kind: str | None = None):
    """src's picklable object on every rank (a few hundred bytes: shapes, names); `kind` as
    broadcast_tensors' (the pickle's bytes and its 8-byte length, as broadcast_object_list sends them)."""
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=control_group())
    if kind and dist.get_rank() != src:
        traffic.received(kind, src, 8 + len(pickle.dumps(box[0])))
    return box[0]


def max_over_world(t: torch.Tensor) -> torch.Tensor:
    """Element-wise max of a CPU tensor over every rank, in place; → it."""
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=control_group())
    return t


def sum_over_world(t: torch.Tensor) -> torch.Tensor:
    """Element-wise sum of a CPU tensor over every rank, in place; → it."""
    dist.all_reduce(t, group=control_group())
    return t


def gather_to_rank0(t: torch.Tensor) -> list[torch.Tensor] | None:
    """Every rank's CPU tensor (the same shape and dtype everywhere), in rank order, on rank 0; None elsewhere."""
    rows = [torch.empty_like(t) for _ in range(dist.get_world_size())] if dist.get_rank() == 0 else None
    dist.gather(t, rows, dst=0, group=control_group())
    return rows


def barrier() -> None:
    dist.barrier(group=control_group())


# ---- device path: the accelerator's tensors, the default group or DeepSpeed's ------------------
def shapes_of(ts: list[torch.Tensor]) -> list[tuple[tuple, torch.dtype]]:
    return [(tuple(t.shape), t.dtype) for t in ts]


def broadcast_tensors(ts: list[torch.Tensor] | None, n: int, src: int = 0, host: bool = False, group=None,
                      meta: list | None = None, kind: str | None = None) -> list[torch.Tensor]:
    """n tensors (any shapes and dtypes) from src to every rank of `group` (None: all); other ranks
    pass None. Shapes go on the control path to every rank of the world (or come as `meta`,
    shapes_of's list, when the caller sent them already), the tensors on the device path; → them on
    `device()` (the CPU with `host`). `kind`: the receivers put what they received in the traffic
    ledger under it."""
    if meta is None:
        meta = broadcast_object(shapes_of(ts) if dist.get_rank() == src else None, src, kind)
    dev = device()
    if dist.get_rank() == src:
        ts = [t.to(dev) for t in ts]
    else:
        ts = [torch.empty(shape, dtype=dtype, device=dev) for shape, dtype in meta]
    for t in ts:   # group None: the default group (NCCL on GPUs), device tensors
        dist.broadcast(t, src=src, group=group)
    if kind and dist.get_rank() != src:
        traffic.received(kind, src, traffic.tensor_bytes(*ts))
    assert len(ts) == n
    return [t.cpu() for t in ts] if host else ts


def subgroup(ranks: list[int]):
    """A device-path group of `ranks` (collective: every rank of the world calls it, in the same order)."""
    return dist.new_group(ranks, timeout=_TIMEOUT)


def broadcast_(t: torch.Tensor, src: int = 0, host: bool = False, kind: str | None = None) -> torch.Tensor:
    """One tensor whose shape and dtype every rank knows, from src (others pass a buffer of that shape);
    `kind` as broadcast_tensors'."""
    t = t.to(device())
    dist.broadcast(t, src=src)          # the default group: NCCL on GPUs
    if kind and dist.get_rank() != src:
        traffic.received(kind, src, traffic.tensor_bytes(t))
    return t.cpu() if host else t


def nbytes(ts: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def send_tensor(t: torch.Tensor, dst: int) -> None:
    """A tensor to rank dst, whose shape and dtype dst knows (recv_tensor)."""
    dist.send(t.to(device()).contiguous(), dst=dst)     # the default group: NCCL on GPUs


def recv_tensor(shape, dtype: torch.dtype, src: int) -> torch.Tensor:
    """send_tensor's tensor from rank src, on `device()`."""
    t = torch.empty(shape, dtype=dtype, device=device())
    dist.recv(t, src=src)                               # the default group: NCCL on GPUs
    return t


def send_bytes(blob: bytes, dst: int, extra: list[int] = ()) -> None:
    """A byte string to rank dst: its length and `extra` ints on the control path, the bytes on the
    device path."""
    dist.send(torch.tensor([len(blob), *extra], dtype=torch.int64), dst=dst, group=control_group())
    if blob:
        send_tensor(torch.frombuffer(bytearray(blob), dtype=torch.uint8), dst)


def recv_bytes(src: int, n_extra: int = 0, kind: str | None = None) -> tuple[bytes, list[int]]:
    """send_bytes's byte string from rank src → (it, the extra ints); `kind`: into the traffic ledger
    under it, the header included."""
    head = torch.empty(1 + n_extra, dtype=torch.int64)
    dist.recv(head, src=src, group=control_group())
    n = int(head[0])
    blob = recv_tensor((n,), torch.uint8, src).cpu().numpy().tobytes() if n else b""
    if kind:
        traffic.received(kind, src, traffic.tensor_bytes(head) + n)
    return blob, [int(x) for x in head[1:]]


def all_reduce_sum_(t: torch.Tensor, group) -> torch.Tensor:
    """In-place sum over a DeepSpeed group of a tensor already on `device()`; → it."""
    assert t.device == device(), f"{t.device} is not this rank's device {device()}"
    dist.all_reduce(t, group=group)
    return t


# ---- the test hook ------------------------------------------------------------------------------
RECORDED = ("broadcast", "all_reduce", "reduce", "send", "recv", "isend", "irecv", "gather", "scatter", "all_gather",
            "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "barrier", "monitored_barrier",
            "broadcast_object_list", "all_gather_object", "gather_object", "batch_isend_irecv")


def _record_calls(out: pathlib.Path) -> None:
    """The module docstring's test hook: every torch.distributed collective, recorded before it runs."""
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / f"{os.getpid()}.jsonl", "a", buffering=1)
    log.write(json.dumps({"rank": dist.get_rank(), "device": str(device())}) + "\n")
    package = str(pathlib.Path(__file__).resolve().parents[1])
    for name in RECORDED:
        fn = getattr(dist, name, None)
        if fn is not None:
            setattr(dist, name, _recording(fn, name, log, package))


def _recording(fn, name: str, log, package: str):
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        bound = sig.bind_partial(*args, **kwargs).arguments
        group = bound.get("group")
        tensors = [t for v in bound.values() for t in (v if isinstance(v, (list, tuple)) else [v])
                   if isinstance(t, torch.Tensor)]
        caller = sys._getframe(1).f_code.co_filename
        where = ("ds_twocircuit/" + str(pathlib.Path(caller).resolve().relative_to(package))
                 if caller.startswith(package) else "deepspeed" if "deepspeed" in caller else caller)
        log.write(json.dumps({"op": name, "caller": where, "control": group is not None and group is _CONTROL,
                              "backend": str(dist.get_backend(group)), "devices": sorted({str(t.device) for t in tensors})})
                  + "\n")
        return fn(*args, **kwargs)
    return call
