"""Moving tensors between the trainer's ranks outside the pipeline schedule (torch.distributed).

    broadcast_tensors     a list of tensors of any shapes and dtypes from one rank to all

It does not go through DeepSpeed's p2p layer, so it is not counted as boundary traffic. The
sampler's weight sync, which also travels outside it, is sync/weight_sync.py.
"""
import torch
import torch.distributed as dist


def broadcast_tensors(ts: list[torch.Tensor] | None, n: int, src: int = 0) -> list[torch.Tensor]:
    """Broadcast a list of n tensors (any shapes/dtypes) from src; other ranks pass None."""
    meta = [None]
    if dist.get_rank() == src:
        meta = [[(tuple(t.shape), t.dtype) for t in ts]]
    dist.broadcast_object_list(meta, src=src)   # shapes only: a few hundred bytes, within our own world
    if dist.get_rank() != src:
        ts = [torch.empty(shape, dtype=dtype) for shape, dtype in meta[0]]
    for t in ts:
        dist.broadcast(t, src=src)
    assert len(ts) == n
    return ts
