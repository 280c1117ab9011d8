"""Receive buffers whose dtype is the sender's.

DeepSpeed 0.19.8's pipeline engine takes every receive buffer of a stage, incoming activations and
incoming gradients alike, from one pool indexed by the tensor's position in its tuple
(`PipelineEngine._allocate_or_extend_buffers`): a pooled buffer with enough elements is handed out
as a view of the requested shape in the dtype it already has. A stage whose two cuts carry
different wire dtypes (a dense fp32 cut in, the rotated codec's fp16 carrier out, or the reverse;
bf16 activations beside an fp32 payload) then receives into the wrong dtype: on gloo a size
mismatch or silently reinterpreted values, on NCCL a send and a receive that disagree in datatype
and count (a hang or corrupt data).

`fit_dtypes(engine)` replaces that method on the engine with one that keeps a pooled buffer only
when its dtype is the one asked for and reallocates otherwise. DeepSpeed's own uses are unchanged
(position, size, reuse, `reset_activation_shape` emptying the pool); a stage whose cuts agree in
dtype allocates exactly what it did before.
"""
import math
import types


def _allocate_or_extend_buffers(self, idx: int, shape, dtype):
    numel = math.prod(shape)
    pool = self._grad_layer_buf
    if idx < len(pool) and pool[idx].dtype == dtype and pool[idx].numel() >= numel:
        return pool[idx].flatten()[:numel].view(shape)
    buf = self._allocate_buffer(shape, dtype=dtype, num_buffers=1)[0]
    if idx < len(pool):
        pool[idx] = buf
    else:
        pool.append(buf)
    return buf


def fit_dtypes(engine) -> None:
    """Make `engine`'s receive buffers match the dtype of what is sent (see the module docstring)."""
    engine._allocate_or_extend_buffers = types.MethodType(_allocate_or_extend_buffers, engine)
