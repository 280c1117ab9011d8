"""Launched by test_codec_dist.py under `deepspeed --num_gpus N`: gradients of a compressed pipeline.

One train_batch of two micro-batches through a codec on every cut, with a fixed linear loss on the
logits; each stage writes the gradients its optimizer receives, under HF names, to
OUT/k{spec}/grads_stage{s}.safetensors (several codecs in one launch). A spec is k of the PRF codec
("3"), or "r{m}x{b}[t{tile}]/{m}x{b}[t{tile}]": the rotated codec's forward and backward budgets
("/q{r}": the backward's rank-r code; a trailing "g": Gaussian levels); a spec ending in "s" shares
each group's prompt (grpo.share_prompts, groups of 2 rows). `reference_grads` computes the same in one
process with plain autograd through the same layer modules and the same codec state.
"""
import json
import os
import sys

import torch

from ds_twocircuit.codec.boundary import Codec
from ds_twocircuit.codec.rotated import Budget
from ds_twocircuit.codec.geometry import cut_layers
from ds_twocircuit.model.pipe import TwoCircuitPipe, layer_specs, load_hf_config, tied_head
from ds_twocircuit.model.weights import SafetensorsReader


STEP = 3   # the masks' key step, in both the pipeline and the reference


def make_codec(d: int, spec: str, split: list[int]) -> Codec:
    spec = spec.removesuffix("s")
    if not spec.startswith("r"):
        return Codec(name="prf", d=d, k=int(spec), seed=5, cuts=cut_layers(split))
    fwd, bwd = spec[1:].split("/")
    rank = int(bwd[1:]) if bwd.startswith("q") else 0
    budget = lambda part: Budget(d, *map(int, part.rstrip("g").replace("t", "x").split("x")),
                                 levels="gauss" if part.endswith("g") else "uniform")
    return Codec(name="rotated", d=d, seed=5, cuts=cut_layers(split), fwd=budget(fwd),
                 bwd=budget("20x2" if rank else bwd), bwd_rank=rank)


def micro_batches(vocab: int, shared: bool = False):
    """Two micro-batches of 2 rows × 6 columns with the linear loss's weights; `shared`: each micro-
    batch is one group of 2 whose first P = 3 columns (one left pad, two prompt tokens) are equal."""
    g = torch.Generator().manual_seed(1)
    out = []
    for m in range(2):
        ids = torch.randint(3, vocab, (2, 6), generator=g)
        attn = torch.ones(2, 6, dtype=torch.long)
        attn[1, :2] = 0
        extra = ()
        if shared:
            attn[:, :1], attn[1, 1] = 0, 1
            ids[1, :3] = ids[0, :3]
            extra = (torch.tensor([3, 2]),)
        r = torch.randn(2, 6, vocab, generator=g)
        out.append(((ids, attn, torch.tensor([2 * m, 2 * m + 1]), *extra), r))
    return out


def linear_loss(out, r):
    return (out.logits() * r).sum()


def reference_grads(model_dir: str, split: list[int], spec) -> dict[str, torch.Tensor]:
    config = load_hf_config(model_dir, "sdpa")
    codec = make_codec(config.hidden_size, str(spec), split)
    specs = layer_specs(config, SafetensorsReader(model_dir), codec, split)
    mods, embed = [], None
    for s in specs:
        if getattr(s, "key", None) == "embed":
            if embed is None:
                embed = s.build()
                mods.append(embed)
            else:
                mods.append(lambda h, e=embed: tied_head(e, h))
        else:
            mods.append(s.build())
    total = 0.0
    with codec.keyed(STEP):
        for inputs, r in micro_batches(config.vocab_size, str(spec).endswith("s")):
            x = inputs
            for m in mods:
                x = m(x)
            total = total + linear_loss(x, r) / 2          # DeepSpeed divides by accumulation steps
    total.backward()
    out = {}
    for m in mods:
        if hasattr(m, "hf_parameters"):
            out.update({n: p.grad.clone() for n, p in m.hf_parameters().items()})
    return out


def main(model_dir, split_json, ks, out_dir):
    """ks: comma-separated codec specs, one train_batch each in the same launch (OUT/k{spec}/...)."""
    import deepspeed
    from safetensors.torch import save_file

    from ds_twocircuit.pipeline.engine import init_distributed
    init_distributed(timeout_s=600)
    split = json.loads(split_json)
    config = load_hf_config(model_dir, "sdpa")
    ks = ks.split(",")
    pipe = TwoCircuitPipe(model_dir, split, linear_loss, codec=make_codec(config.hidden_size, "3", split))
    engine, *_ = deepspeed.initialize(
        model=pipe, optimizer=torch.optim.SGD(pipe.parameters(), lr=0.0),
        config={"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 0.0,
                "steps_per_print": 10**6})
    grads = {}
    engine.optimizer.register_step_pre_hook(
        lambda *_: grads.update({n: p.grad.clone() for n, p in pipe.hf_parameters().items()}))
    for k in ks:
        c = make_codec(config.hidden_size, k, split)
        # every layer holds this one codec object: change it in place
        pipe.codec.name, pipe.codec.k, pipe.codec.fwd, pipe.codec.bwd, pipe.codec.bwd_rank = \
            c.name, c.k, c.fwd, c.bwd, c.bwd_rank
        engine.reset_activation_shape()    # the payload's width changes with the codec
        with pipe.codec.keyed(STEP):
            engine.train_batch(iter(micro_batches(config.vocab_size, k.endswith("s"))))
        os.makedirs(f"{out_dir}/k{k.replace('/', '_')}", exist_ok=True)
        save_file(grads, f"{out_dir}/k{k.replace('/', '_')}/grads_stage{pipe.stage_id}.safetensors")


if __name__ == "__main__":
    main(*[a for a in sys.argv[1:] if not a.startswith("--local_rank")])
