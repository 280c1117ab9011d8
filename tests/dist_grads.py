"""Launched by test_codec_dist.py under `deepspeed --num_gpus N`: what crosses each cut of a compressed
pipeline, and the gradients it gives.

One train_batch of two micro-batches per codec spec, all in one launch, with a fixed linear loss on
the logits. Each stage writes
- the gradients its optimizer receives, under HF names, to OUT/k{spec}/grads_stage{s}.safetensors;
- what each of its cuts saw, to OUT/k{spec}/cuts_stage{s}.pt: as a sender, the hidden state it encoded
  ("x/{layer}/{mb}") and the gradient the backward code decoded into ("gx/{layer}/{mb}"); as a
  receiver, the hidden state it decoded ("xhat/{layer}/{mb}") and the gradient it coded back
  ("gxhat/{layer}/{mb}"), `layer` the decoder layer after which the cut sits. Recorded on the HF
  layers' inputs and outputs, outside the codec and the `Decoder` wrappers, so a test can check each
  cut against the codec's pure functions keyed explicitly.

A spec is `[c{l}.{l}...:]{codec}[t][s]`: the codec is k of the PRF codec ("3"), or
"r{m}x{b}[t{tile}]/{m}x{b}[t{tile}]": the rotated codec's forward and backward budgets ("/q{r}": the
backward's rank-r code; a trailing "g": Gaussian levels); the "c" prefix compresses only the cuts
after those layers (codec.boundaries; the others send dense fp32 beside the codec's dtypes); "t"
trims: the second micro-batch is narrower and DeepSpeed sends shapes with every micro-batch (its
dynamic_shape, as a trimmed pass runs); "s" shares each group's prompt (grpo.share_prompts, groups of
2 rows). `reference_grads` computes the gradients in one process with plain autograd through the
same layer modules and the same codec state.

The launch runs with the product's receive buffers (pipeline/recv_buffers.py) and its p2p hook
(pipeline/wire.py), whose strict check the tests switch on: every receive agrees with its send in
dtype and element count.
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


SEED = 5


def parse(spec: str) -> tuple[list[int] | None, str, bool, bool]:
    """→ (compressed cut layers or None for every cut, the codec part, trimmed, shared)."""
    cuts = None
    if spec.startswith("c"):
        head, spec = spec[1:].split(":")
        cuts = [int(l) for l in head.split(".")]
    shared, spec = spec.endswith("s"), spec.removesuffix("s")
    trimmed, spec = spec.endswith("t"), spec.removesuffix("t")
    return cuts, spec, trimmed, shared


def make_codec(d: int, spec: str, split: list[int]) -> Codec:
    cuts, spec, _, _ = parse(spec)
    cuts = cut_layers(split) if cuts is None else cuts
    if not spec.startswith("r"):
        return Codec(name="prf", d=d, k=int(spec), seed=SEED, cuts=cuts)
    fwd, bwd = spec[1:].split("/")
    rank = int(bwd[1:]) if bwd.startswith("q") else 0
    budget = lambda part: Budget(d, *map(int, part.rstrip("g").replace("t", "x").split("x")),
                                 levels="gauss" if part.endswith("g") else "uniform")
    return Codec(name="rotated", d=d, seed=SEED, cuts=cuts, fwd=budget(fwd),
                 bwd=budget("20x2" if rank else bwd), bwd_rank=rank)


def micro_batches(vocab: int, shared: bool = False, trimmed: bool = False):
    """Two micro-batches of 2 rows × 6 columns (the second 4 columns wide when `trimmed`) with the
    linear loss's weights; `shared`: each micro-batch is one group of 2 whose first P columns (one
    left pad, then prompt tokens; P = 3, or 2 in a 4-column one) are equal."""
    g = torch.Generator().manual_seed(1)
    out = []
    for m in range(2):
        T = 4 if trimmed and m == 1 else 6
        ids = torch.randint(3, vocab, (2, T), generator=g)
        attn = torch.ones(2, T, dtype=torch.long)
        attn[1, :T - 4] = 0
        extra = ()
        if shared:
            P = T // 2
            attn[:, :1], attn[1, 1:] = 0, 1
            ids[1, :P] = ids[0, :P]
            extra = (torch.tensor([P, 2]),)
        r = torch.randn(2, T, vocab, generator=g)
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
    _, _, trimmed, shared = parse(str(spec))
    with codec.keyed(STEP):
        for inputs, r in micro_batches(config.vocab_size, shared, trimmed):
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


def record_cuts(pipe) -> dict:
    """Hooks on this stage's HF decoder layers at a cut (module docstring); → the dict they fill,
    keyed "{role}/{layer}/{micro-batch}" (clear it between train_batches)."""
    from ds_twocircuit.model.pipe import Decoder
    rec, calls = {}, {}

    def put(role, layer, t):
        n = calls[role, layer] = calls.get((role, layer), -1) + 1
        rec[f"{role}/{layer}/{n}"] = t.detach().cpu().clone()

    def grad_hook(role, layer):
        return lambda g: put(role, layer, g)

    def received(cut):
        def hook(mod, args):
            put("xhat", cut, args[0])
            args[0].register_hook(grad_hook("gxhat", cut))
        return hook

    def sent(cut):
        def hook(mod, args, out):
            put("x", cut, out)
            out.register_hook(grad_hook("gx", cut))
        return hook

    for m in pipe.modules():
        if isinstance(m, Decoder) and m.decode_in:
            m.layer.register_forward_pre_hook(received(m.layer_idx - 1))
        if isinstance(m, Decoder) and m.encode_out:
            m.layer.register_forward_hook(sent(m.layer_idx))
    return rec, calls


def main(model_dir, split_json, ks, out_dir, timeout_s="600"):
    """ks: comma-separated codec specs, one train_batch each in the same launch (OUT/k{spec}/...);
    `timeout_s`: every collective's bound (a hang fails fast)."""
    import deepspeed
    from safetensors.torch import save_file

    from ds_twocircuit.pipeline import recv_buffers, wire
    from ds_twocircuit.pipeline.engine import init_distributed
    init_distributed(timeout_s=float(timeout_s))
    split = json.loads(split_json)
    config = load_hf_config(model_dir, "sdpa")
    ks = ks.split(",")
    pipe = TwoCircuitPipe(model_dir, split, linear_loss, codec=make_codec(config.hidden_size, "3", split))
    engine, *_ = deepspeed.initialize(
        model=pipe, optimizer=torch.optim.SGD(pipe.parameters(), lr=0.0),
        config={"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 0.0,
                "steps_per_print": 10**6})
    recv_buffers.fit_dtypes(engine)
    wire.install(pipe.stage_id)
    grads = {}
    engine.optimizer.register_step_pre_hook(
        lambda *_: grads.update({n: p.grad.cpu().clone() for n, p in pipe.hf_parameters().items()}))
    rec, calls = record_cuts(pipe)
    for k in ks:
        c = make_codec(config.hidden_size, k, split)
        _, _, trimmed, shared = parse(k)
        # every layer holds this one codec object: change it in place
        pipe.codec.name, pipe.codec.k, pipe.codec.fwd, pipe.codec.bwd, pipe.codec.bwd_rank, pipe.codec.cuts = \
            c.name, c.k, c.fwd, c.bwd, c.bwd_rank, c.cuts
        engine.reset_activation_shape()    # the payload's width changes with the codec
        engine.dynamic_shape = trimmed     # shapes with every micro-batch, as a trimmed pass (passes.shaped)
        rec.clear(), calls.clear()
        with pipe.codec.keyed(STEP):
            engine.train_batch(iter(micro_batches(config.vocab_size, shared, trimmed)))
        out = f"{out_dir}/k{k.replace('/', '_')}"
        os.makedirs(out, exist_ok=True)
        save_file(grads, f"{out}/grads_stage{pipe.stage_id}.safetensors")
        torch.save(dict(rec), f"{out}/cuts_stage{pipe.stage_id}.pt")


if __name__ == "__main__":
    main(*[a for a in sys.argv[1:] if not a.startswith("--local_rank")])
