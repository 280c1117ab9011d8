"""Moving tensors between the trainer's ranks outside the pipeline schedule (torch.distributed).

    broadcast_tensors     a list of tensors of any shapes and dtypes from one rank to all
    gather_stage_weights  every stage's dense weights to global rank 0 (the sampler's host)

Neither goes through DeepSpeed's p2p layer, so neither is counted as boundary traffic.
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


def gather_stage_weights(grid, pipe, shapes: dict | None) -> tuple[list | None, int]:
    """Dense weights from every stage to global rank 0 (p2p, one flat fp32 buffer per stage).

    `shapes`: HF name → (shape, dtype) of the whole model, on rank 0. → (list of (HF name, tensor))
    on rank 0, None elsewhere; and the bytes rank 0 received. Rank 0's own stage comes as views of
    its live parameters: valid until its next optimizer step."""
    names = pipe.hf_names_per_stage()
    if grid.get_data_parallel_rank() != 0:
        return None, 0
    mine = pipe.hf_parameters()
    if dist.get_rank() != 0:
        flat = torch.cat([mine[n].detach().float().reshape(-1) for n in names[pipe.stage_id]])
        dist.send(flat, dst=0)
        return None, 0
    out, nbytes = [(n, mine[n].detach()) for n in names[0]], 0
    for s in range(1, pipe.num_stages):
        numel = [shapes[n][0].numel() for n in names[s]]
        flat = torch.empty(sum(numel))
        dist.recv(flat, src=grid.stage_to_global(stage_id=s, data=0))
        nbytes += flat.numel() * flat.element_size()
        out += [(n, t.view(shapes[n][0])) for n, t in zip(names[s], flat.split(numel))]
    return out, nbytes
