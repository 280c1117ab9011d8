"""Generation through the boundary codec: the inference-time compression check.

A frozen HF checkpoint generates with every cut's hidden state taking the round trip the pipeline
would give it, x̂ = decode(encode(x)), at the cut's decoder layer:

    prf      exact-k kept set keyed by (seed, layer, step = 0, row, position), scaled by d/k
    lowrank  a static basis Q (d × k): the top-k right singular vectors of calibration activations
             at that cut (a "static SVD basis"), x̂ = x·Q·Qᵀ

so a user can read how much of a model's accuracy survives generation at a budget, next to the dense
model's. The hooks are plain forward hooks on the HF decoder layers; positions come from the
`position_ids` HF passes to each layer (left padding and the KV cache included).
"""
import contextlib

import torch

from .boundary import Codec
from .lowrank import top_basis


@contextlib.contextmanager
def through_codec(model, codec: Codec):
    """Within the block, `model` (an HF causal LM) runs every cut in `codec.cuts` through `codec`."""
    hooks = []

    def hook(module, args, kwargs, out, layer):
        h = out[0] if isinstance(out, tuple) else out
        pos = kwargs["position_ids"].expand(h.shape[0], -1)
        sid = torch.arange(h.shape[0])
        y = codec.decode(codec.encode(h, pos, sid, layer), pos, sid, layer, h.dtype)
        return (y, *out[1:]) if isinstance(out, tuple) else y

    for i in sorted(codec.cuts):
        hooks.append(model.model.layers[i].register_forward_hook(
            lambda m, a, kw, o, i=i: hook(m, a, kw, o, i), with_kwargs=True))
    try:
        yield model
    finally:
        for h in hooks:
            h.remove()


@torch.no_grad()
def static_bases(model, enc: dict, cuts: list[int], k: int) -> dict[int, torch.Tensor]:
    """Top-k basis of each cut's activations (non-padding tokens) over a calibration batch `enc`."""
    acts: dict[int, list] = {}
    hooks = [model.model.layers[i].register_forward_hook(
        lambda m, a, o, i=i: acts.setdefault(i, []).append(o[0] if isinstance(o, tuple) else o)) for i in cuts]
    try:
        model(**enc)
    finally:
        for h in hooks:
            h.remove()
    keep = enc["attention_mask"].bool()
    return {i: top_basis(torch.cat(acts[i])[keep], k) for i in cuts}
