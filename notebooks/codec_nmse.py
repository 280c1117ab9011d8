"""Per-cut NMSE of boundary codecs on real tensors of the embedded default.

    python notebooks/codec_nmse.py [--prompts 32] [--group 8] [--wide | --embedded-wide] [--tiles 16 64 128]

One GRPO-sized batch (B prompts × G samples from the HF sampler, the base model), one dense forward
and backward of the sampled tokens' log-likelihood through the HF model; at each of the 7 cuts of
the 8-stage split, the activation x (forward) and the gradient g (backward) of every real token are
kept. For each codec, NMSE = Σ‖x̂ − x‖² / Σ‖x‖² per cut (and the same for g), each token keyed as
in training (seed, cut layer, step 1, sample, position). The activations only pass through one codec
at a time here: what the compressed pipeline's later cuts see after earlier cuts is not measured.
`--tiles`: each rotated budget also with an 8-bit scale per that many coordinates (protocol v2), and
at ≤ 4 bits with Gaussian (Lloyd–Max) levels scaled by each tile's RMS (`codec.fwd_levels=gauss`).
`--embedded-wide`: the warm-started wide embedded model (`model.embedded=wide`, d = 384), at
`--wide-warmup-steps` (default 200, the learning control of the wide runs).
`--wide`: the model of `prf95_wide.json` (8 layers at hidden 1536, 12 heads, random init, no warm
start, 8 stages of 1 layer), budgets scaled to its width; a random-init model has none of a trained
LLM's outlier channels, so its numbers say nothing about those.
"""
import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from ds_twocircuit.codec import prf, rotated  # noqa: E402
from ds_twocircuit.codec.geometry import cut_layers  # noqa: E402
from ds_twocircuit.config.schema import TinyModelConfig, WideModelConfig  # noqa: E402
from ds_twocircuit.data.synthetic import synthetic_splits  # noqa: E402
from ds_twocircuit.model.pipe import positions_from_mask  # noqa: E402
from ds_twocircuit.model.tiny import ensure_tiny_model  # noqa: E402
from ds_twocircuit.sampler.hf import HFSampler  # noqa: E402


def cut_tensors(model_dir: str, prompts: int, group: int, split: list[int]):
    """→ {cut layer: (x (N, d), g (N, d), keys (N,) per direction)} for the real tokens."""
    s = HFSampler(model_dir)
    gen = s.generate(synthetic_splits(512)[0]["problem"][:prompts], group, max_new_tokens=5, seed=0)
    model, layers = s.model, cut_layers(split)
    acts = {}
    hooks = [model.model.layers[l].register_forward_hook(
        lambda mod, inp, out, l=l: acts.__setitem__(l, (out[0] if isinstance(out, tuple) else out))) for l in layers]
    pos = positions_from_mask(gen.attn_NT)
    logits = model(input_ids=gen.ids_NT, attention_mask=gen.attn_NT, position_ids=pos).logits[:, :-1]
    for a in acts.values():
        a.retain_grad()
    lp = torch.log_softmax(logits.float(), -1).gather(-1, gen.ids_NT[:, 1:, None])[..., 0]
    (lp * gen.resp_NT1).sum().backward()
    for h in hooks:
        h.remove()
    real = gen.attn_NT.bool()
    sid = torch.arange(gen.ids_NT.shape[0])[:, None].expand_as(pos)
    out = {}
    for l in layers:
        keys = prf.token_keys(0, l, 1, sid[real], pos[real])
        out[l] = (acts[l].detach()[real], acts[l].grad[real], keys)
    return out


def prf_roundtrip(x, keys, k):
    d = x.shape[-1]
    idx = prf.kept_channels(keys, d, k)
    return torch.zeros_like(x).scatter(-1, idx, x.gather(-1, idx) * (d / k))


def rotated_roundtrip(x, keys, budget, direction):
    return rotated.decode(rotated.encode(x, keys, budget, direction), keys, budget, direction)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--wide", action="store_true", help="the 1536-wide random-init model of prf95_wide.json")
    ap.add_argument("--embedded-wide", action="store_true", help="the warm-started wide embedded model (d = 384)")
    ap.add_argument("--wide-warmup-steps", type=int, default=200, help="its warm start (model.wide.warmup_steps)")
    ap.add_argument("--tiles", type=int, nargs="*", default=[16, 64, 128],
                    help="also code with an 8-bit scale per this many coordinates (protocol v2), each below d")
    a = ap.parse_args()
    torch.manual_seed(0)
    if a.wide:
        tiny = TinyModelConfig(hidden_size=1536, num_layers=8, num_heads=12, num_kv_heads=2, warmup_steps=0)
        cuts = cut_tensors(ensure_tiny_model(tiny, 16), a.prompts, a.group, [1] * 8)
    elif a.embedded_wide:
        cuts = cut_tensors(ensure_tiny_model(WideModelConfig(warmup_steps=a.wide_warmup_steps), 512, "wide"), a.prompts, a.group, [4, 4, 4, 4, 3, 3, 3, 3])
    else:
        cuts = cut_tensors(ensure_tiny_model(TinyModelConfig(), 512), a.prompts, a.group, [4, 4, 4, 4, 3, 3, 3, 3])
    d = next(iter(cuts.values()))[0].shape[-1]
    k = round(0.05 * d)
    codecs = {f"prf k={k} fp32 ({4 * k} B)": lambda x, keys, dr: prf_roundtrip(x, keys, k)}
    tiles = [0] + [t for t in a.tiles if t < d]
    for m, bits in ((d * 5 // 8, 2), (d, 2), (d, 3), (d, 4)):   # at d = 64: 40, 64, 64, 64 coordinates
        for tile in tiles:
            b = rotated.Budget(d, m, bits, tile)
            codecs[f"rotated m={m} {bits}-bit{f' tile {tile}' if tile else ''} ({b.bytes_per_token} B)"] = \
                lambda x, k, dr, b=b: rotated_roundtrip(x, k, b, dr)
            if tile and bits <= 4:
                g = rotated.Budget(d, m, bits, tile, "gauss")
                codecs[f"rotated m={m} {bits}-bit tile {tile} gauss ({g.bytes_per_token} B)"] = \
                    lambda x, k, dr, g=g: rotated_roundtrip(x, k, g, dr)
    nmse = lambda xh, x: float(((xh - x) ** 2).sum() / (x ** 2).sum())
    print(f"N = {next(iter(cuts.values()))[0].shape[0]} real tokens per cut, d = {d}; NMSE fwd / bwd per cut "
          f"(layers {list(cuts)})\n")
    print("| codec | " + " | ".join(f"cut {l}" for l in cuts) + " | mean |\n|---|" + "---|" * (len(cuts) + 1))
    for name, f in codecs.items():
        cells = [(nmse(f(x, k, "fwd"), x), nmse(f(g, k, "bwd"), g)) for x, g, k in cuts.values()]
        fm, bm = sum(c[0] for c in cells) / len(cells), sum(c[1] for c in cells) / len(cells)
        print(f"| {name} | " + " | ".join(f"{fw:.3g} / {bw:.3g}" for fw, bw in cells) + f" | {fm:.3g} / {bm:.3g} |")


if __name__ == "__main__":
    main()
