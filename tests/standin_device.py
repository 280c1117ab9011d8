"""A stand-in accelerator for placement tests on a CPU machine: tensors that hold CPU data but say
they live on another device, under CUDA's placement rules.

`OnDevice(t)` wraps a CPU tensor; it reports the device `STANDIN` ("meta"), so code that allocates
with `device=x.device` allocates there (the `placed()` mode turns such factory calls into wrapped
CPU tensors). Every op runs on the real data, so data-dependent code (nonzero, .item()) works,
unlike on the meta device or under FakeTensorMode; what CUDA refuses, this refuses:

    an op that mixes a wrapped tensor with a plain CPU tensor of one or more dimensions
    (0-dim CPU scalars are allowed, as CUDA allows them; copy_ and .to() may cross devices)
    an in-place op on a plain CPU tensor, 0-dim included, with a wrapped operand
    .numpy() of a wrapped tensor (without .cpu() first)

So a CPU `torch.arange(T)` meeting a stage's input raises here as it would on a GPU.
"""
import contextlib

import torch
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils._python_dispatch import TorchDispatchMode

STANDIN = torch.device("meta")
_CROSSING = {torch.ops.aten.copy_.default, torch.ops.aten._to_copy.default}


class OnDevice(torch.Tensor):
    @staticmethod
    def __new__(cls, elem: torch.Tensor):
        r = torch.Tensor._make_wrapper_subclass(cls, elem.shape, strides=elem.stride(),
                                                storage_offset=elem.storage_offset(), dtype=elem.dtype,
                                                device=STANDIN, requires_grad=elem.requires_grad)
        r.elem = elem
        return r

    def __repr__(self):
        return f"OnDevice({self.elem!r})"

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _run(func, args, kwargs or {})


def _run(func, args, kwargs):
    flat, _ = tree_flatten((args, kwargs))
    tensors = [t for t in flat if isinstance(t, torch.Tensor)]
    on_device = any(isinstance(t, OnDevice) for t in tensors)
    cpu = [t for t in tensors if not isinstance(t, OnDevice) and t.dim() > 0]
    if on_device and cpu and func not in _CROSSING:
        raise RuntimeError(f"{func}: a CPU tensor {tuple(cpu[0].shape)} {cpu[0].dtype} meets a tensor on the device")
    target_self = args[0] if args else None
    if (on_device and func not in _CROSSING and func._schema.name.endswith("_") and isinstance(target_self, torch.Tensor)
            and not isinstance(target_self, OnDevice)):
        raise RuntimeError(f"{func}: an in-place op on a CPU tensor {tuple(target_self.shape)} meets a tensor on the device")
    target = kwargs.get("device")
    to_device = target is not None and torch.device(target) == STANDIN
    if target is not None:
        kwargs = {**kwargs, "device": torch.device("cpu")}
    args, kwargs = tree_map(lambda t: t.elem if isinstance(t, OnDevice) else t, (args, kwargs))
    out = func(*args, **kwargs)
    wrap = to_device or (on_device and target is None)
    return tree_map(lambda t: OnDevice(t) if wrap and isinstance(t, torch.Tensor) else t, out)


class _Factories(TorchDispatchMode):
    """Factory calls with device=STANDIN (torch.zeros(..., device=x.device)) make wrapped tensors."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(issubclass(t, OnDevice) for t in types):
            return NotImplemented
        target = kwargs.get("device")
        if target is not None and torch.device(target) == STANDIN:
            return _run(func, args, kwargs)
        return func(*args, **kwargs)


@contextlib.contextmanager
def placed():
    with _Factories():
        yield


def to_standin(module: torch.nn.Module) -> torch.nn.Module:
    """Every parameter and buffer of `module` moved to the stand-in device, in place."""
    for m in module.modules():
        for n, p in list(m._parameters.items()):
            if p is not None:
                m._parameters[n] = torch.nn.Parameter(OnDevice(p.detach()), requires_grad=p.requires_grad)
        for n, b in list(m._buffers.items()):
            if b is not None:
                m._buffers[n] = OnDevice(b)
    return module


def on(t: torch.Tensor) -> torch.Tensor:
    return OnDevice(t)


def data(t: torch.Tensor) -> torch.Tensor:
    """The CPU data of a wrapped tensor (a plain one as it is)."""
    return t.elem if isinstance(t, OnDevice) else t
