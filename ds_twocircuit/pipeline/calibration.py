"""The lowrank codec's activations, read off the pipeline: recording what crosses each cut, and the
first bases both ends of every cut start from.

`recording_cuts(pipe, layers)` keeps the output of the decoder layers after which the cuts sit, one
(N, d) tensor per micro-batch, for as long as the block runs (run it with the codec off, so what is
kept is the dense activation). The trainer's first bases: a dense forward of teacher-forced training
rows (prompt + answer), the top-k basis of each cut's activations on the sending stage, sent to the
receiving stage (codec/lowrank.py); the anchor refreshes them at every fire from its own replay.
"""
import contextlib

import torch

from . import comm

from ..codec.geometry import cut_layers
from ..codec.lowrank import top_basis
from ..grpo.rollouts import Rollout
from ..model.pipe import Decoder
from .passes import logprobs


@contextlib.contextmanager
def recording_cuts(pipe, layers):
    """Within the block, → {cut layer: [x (N, d) per forward]} of this rank's decoder layers in `layers`."""
    acts: dict[int, list[torch.Tensor]] = {}
    hooks = [m.register_forward_hook(lambda mod, inp, out: acts.setdefault(mod.layer_idx, []).append(
        out[0].detach().reshape(-1, out[0].shape[-1]))) for m in pipe.modules()
        if isinstance(m, Decoder) and m.layer_idx in layers]
    try:
        yield acts
    finally:
        for h in hooks:
            h.remove()


def initial_bases(p, batch: Rollout) -> None:
    """Set every compressed cut's first basis on both of its ends: a dense forward of `batch`, the
    sending stage's top-k basis of the cut's activations, sent to the receiving stage."""
    with p.codec.off(), recording_cuts(p.pipe, p.codec.cuts) as acts:
        logprobs(p, batch)
    grid, dp = p.engine.grid, p.dp_rank
    for b, layer in enumerate(cut_layers(p.pipe.layers_per_stage)):
        if layer not in p.codec.cuts or p.stage not in (b, b + 1):
            continue
        if p.stage == b:
            q = top_basis(torch.cat(acts[layer]), p.codec.k)
            comm.send_tensor(q, grid.stage_to_global(stage_id=b + 1, data=dp))
        else:
            q = comm.recv_tensor((p.codec.d, p.codec.k), torch.float32, grid.stage_to_global(stage_id=b, data=dp))
        p.codec.set_bases({layer: q})


def calibration_batch(tokenizer, task, micro: int) -> Rollout:
    """Teacher-forced training rows (prompt + answer), left-padded: about 64 sequences, a whole
    number of micro-batches (built where the task lives, rank 0; the trainer broadcasts it)."""
    n = micro * max(1, 64 // micro)
    rows = task.train.select(range(n))
    enc = tokenizer([task.prompt(p) + a for p, a in zip(rows["problem"], rows["answer"])], return_tensors="pt",
                    padding=True, padding_side="left", add_special_tokens=False)
    ids, attn = enc["input_ids"], enc["attention_mask"]
    z = torch.zeros(n, ids.shape[1] - 1)
    return Rollout(ids, attn, z, z, torch.zeros(n), torch.zeros(n), torch.arange(n))
