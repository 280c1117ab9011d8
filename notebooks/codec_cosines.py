"""cos(G_comp, G_dense) of one GRPO batch, in one process, for many codec settings and draws.

    python notebooks/codec_cosines.py [--recipe ds_configs/dense.json] [--draws 4] [--spectra]
        [--variants NAME ...] [key=value ...]

The levers of a codec at width, measured without a pipeline launch: one step's batch (B prompts × G
samples from the HF sampler on the run's base model, scored by the task's verifier, group-normalised
advantages), then the GRPO policy gradient at the step's first update (ρ = 1, β = 0: the token-mean of
−Â·∇log π) through the pipeline's own layer modules (model/pipe.py's `layer_specs`) with a codec on
the chosen cuts, in plain autograd. test_codec_dist.py shows this equals the 8-stage pipeline's
gradient for the same codec state, so a row here is what a run's probe would log at step 1 (up to
the batch: a run samples with its own seed). Each variant is drawn `--draws` times with the codec's
seed 0, 1, ... (other masks and dithers); the table gives the mean cosine and its spread, the bytes
per token per direction and the wire of one forward + backward as a share of a bf16 pass pair (the
run's reference pass and the shared-prompt and skip savings are outside this count).

`--spectra`: the dense activation gradients at each cut (tokens × d) and the energy share of their
top 4/16/64 singular directions, what a rank-r backward code could keep.

Variant names: `rot{fwd bits}[t{tile}]/{bwd coords}x{bwd bits}[t{tile}]`, e.g. rot4/240x2,
rot2t64/240x2t64 (forward coordinates are all d), or `rot{fwd bits}[t{tile}]/q{r}` with the backward's
rank-r code (`codec.bwd_rank`); a `g` after the forward's tile: Gaussian levels (`codec.fwd_levels=gauss`),
e.g. rot2t64g/q4; `prf{k}`; a suffix `@L` compresses cut L alone, `@L1,L2,...` those cuts alone.
Variants joined by `+` code disjoint sets of cuts each their own way (bits per cut), e.g.
`rot3t64g/q2@3,24+rot2t64g/q2@7,11,15,18,21`; its bytes are the mean over the model's cuts, a cut
no part codes counted dense (bf16).

Prototypes that are not wire protocols yet, `sim:{fwd}/{bwd}` (each direction coded on its own, the
backward straight through the forward's code):
    fwd  rot{b}[t{tile}]   the rotated code as above (all d coordinates)
         lm{b}t{tile}      rotated, then Lloyd-Max levels of N(0, 1) scaled by each tile's RMS, no
                           dither: the MSE-optimal scalar code of a Gaussian coordinate (biased: it
                           shrinks, E[z | ẑ] = ẑ); counted as the rotated code with tiles
         id                dense (bf16 bytes)
    bwd  rot{m}x{b}[t{tile}], id, or svd{r}: each micro-batch's (tokens × d) gradient truncated to
         its top r singular directions (the exact rank-r code a PowerSGD step approaches; bf16 factors,
         r·(tokens + d) values per micro-batch)
"""
import argparse
import contextlib
import pathlib
import re
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from ds_twocircuit.codec.boundary import Codec, wire_format  # noqa: E402
from ds_twocircuit.codec.geometry import cut_layers  # noqa: E402
from ds_twocircuit.codec.rotated import Budget  # noqa: E402
from ds_twocircuit.config import load_config  # noqa: E402
from ds_twocircuit.grpo.advantages import group_advantages  # noqa: E402
from ds_twocircuit.grpo.logprobs import head_logprobs  # noqa: E402
from ds_twocircuit.grpo.loss import LossCoefs, grpo_token_loss  # noqa: E402
from ds_twocircuit.model.pipe import layer_specs, load_hf_config, tied_head  # noqa: E402
from ds_twocircuit.model.weights import SafetensorsReader, base_model_dir  # noqa: E402
from ds_twocircuit.sampler.hf import HFSampler  # noqa: E402

SPEC = re.compile(r"rot(?P<fb>\d+)(?:t(?P<ft>\d+))?(?P<g>g)?/(?:(?P<bm>\d+)x(?P<bb>\d+)(?:t(?P<bt>\d+))?|q(?P<q>\d+))$"
                  r"|prf(?P<k>\d+)$")


def make_codec(name: str, d: int, cuts: list[int], seed: int, micro: int = 32) -> Codec:
    """A variant name (module docstring) → the codec on `cuts` (or on the cuts after '@')."""
    if "+" in name:
        return MixCodec(d, cuts, seed, [make_codec(part, d, cuts, seed, micro) for part in name.split("+")])
    name, _, only = name.partition("@")
    cuts = [int(c) for c in only.split(",")] if only else cuts
    if name.startswith("sim:"):
        fwd, bwd = name[4:].split("/")
        return SimCodec(d, cuts, seed, fwd, bwd, micro)
    m = SPEC.match(name)
    if m is None:
        raise SystemExit(f"variant {name!r}: expected rot<b>[t<tile>]/<m>x<b>[t<tile>] or prf<k>")
    v = {k: int(x) for k, x in m.groupdict().items() if x and k != "g"}
    if "k" in v:
        return Codec(name="prf", d=d, k=v["k"], seed=seed, cuts=cuts)
    fwd = Budget(d, d, v["fb"], v.get("ft", 0), "gauss" if m.group("g") else "uniform")
    return Codec(name="rotated", d=d, seed=seed, cuts=cuts, fwd=fwd,
                 bwd=Budget(d, v.get("bm", d), v.get("bb", 2), v.get("bt", 0)), bwd_rank=v.get("q", 0))


def lloyd_max_roundtrip(x_ND, keys_N, bits: int, tile: int):
    """Rotate, code each coordinate by the nearest Lloyd-Max level times its tile's RMS, unrotate."""
    from ds_twocircuit.codec import rotated
    N, d = x_ND.shape
    s = rotated.signs(keys_N, d)
    z = rotated.rotate(x_ND.float(), s).view(N, d // tile, tile)
    rms = z.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-30)
    levels = rotated.gauss_levels(bits)
    zq = levels[((z / rms)[..., None] - levels).abs().argmin(-1)] * rms
    return rotated.unrotate(zq.view(N, d), s)


def svd_roundtrip(g_BTD, rank: int, micro: int):
    """Each micro-batch's (tokens × d) gradient, truncated to its top `rank` singular directions."""
    out = []
    for g in g_BTD.split(micro):
        m = g.reshape(-1, g.shape[-1]).double()
        u, s, vh = torch.linalg.svd(m, full_matrices=False)
        out.append(((u[:, :rank] * s[:rank]) @ vh[:rank]).view_as(g).to(g.dtype))
    return torch.cat(out)


class _Sim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fwd, bwd):
        ctx.bwd = bwd
        return fwd(x)

    @staticmethod
    def backward(ctx, g):
        return ctx.bwd(g), None, None


class SimCodec(Codec):
    """A prototype at each compressed cut: x̂ = fwd(x) forward, ∂x = bwd(∂x̂) backward."""

    def __init__(self, d, cuts, seed, fwd: str, bwd: str, micro: int):
        super().__init__(name="sim", d=d, seed=seed, cuts=cuts)
        self.fwd_spec, self.bwd_spec, self.micro = fwd, bwd, micro

    def _map(self, spec: str, keys_BT, direction: str):
        from ds_twocircuit.codec import rotated
        d = self.d
        if spec == "id":
            return lambda t: t
        if m := re.fullmatch(r"svd(\d+)", spec):
            return lambda t: svd_roundtrip(t, int(m.group(1)), self.micro)
        if m := re.fullmatch(r"lm(\d+)t(\d+)", spec):
            return lambda t: lloyd_max_roundtrip(t.reshape(-1, d), keys_BT.reshape(-1), int(m.group(1)),
                                                 int(m.group(2))).view_as(t).to(t.dtype)
        m = re.fullmatch(r"rot(?:(\d+)x)?(\d+)(?:t(\d+))?", spec)
        b = rotated.Budget(d, int(m.group(1) or d), int(m.group(2)), int(m.group(3) or 0))
        k = keys_BT.reshape(-1)
        return lambda t: rotated.decode(rotated.encode(t.reshape(-1, d), k, b, direction), k, b,
                                        direction).view_as(t).to(t.dtype)

    def wire_out(self, x_BTD, pos_BT, sid_B, layer):
        if not self.active(layer):
            return (x_BTD,)
        keys = self._keys(pos_BT, sid_B, layer)
        return (_Sim.apply(x_BTD, self._map(self.fwd_spec, keys, "fwd"), self._map(self.bwd_spec, keys, "bwd")),)

    def wire_in(self, wire, pos_BT, sid_B, layer, dtype):
        return wire[0]

    def bytes_per_token(self, spec: str, tokens_per_micro: float) -> float:
        from ds_twocircuit.codec import rotated
        d = self.d
        if spec == "id":
            return 2.0 * d
        if m := re.fullmatch(r"svd(\d+)", spec):
            return 2.0 * int(m.group(1)) * (tokens_per_micro + d) / tokens_per_micro
        if m := re.fullmatch(r"lm(\d+)t(\d+)", spec):
            return float(rotated.Budget(d, d, int(m.group(1)), int(m.group(2))).bytes_per_token)
        m = re.fullmatch(r"rot(?:(\d+)x)?(\d+)(?:t(\d+))?", spec)
        return float(rotated.Budget(d, int(m.group(1) or d), int(m.group(2)), int(m.group(3) or 0)).bytes_per_token)


class MixCodec(Codec):
    """Each cut coded by the part whose cuts hold it (parts on disjoint cuts); other cuts dense."""

    def __init__(self, d, cuts, seed, parts: list[Codec]):
        super().__init__(name="mix", d=d, seed=seed, cuts=cuts)
        held = [c for p in parts for c in p.cuts]
        if len(held) != len(set(held)):
            raise SystemExit(f"mix: a cut is coded by two parts ({sorted(held)})")
        self.parts, self.all_cuts = parts, list(cuts)

    def _part(self, layer: int) -> Codec | None:
        return next((p for p in self.parts if layer in p.cuts), None)

    @contextlib.contextmanager
    def keyed(self, step: int):
        with contextlib.ExitStack() as stack:
            for p in self.parts:
                stack.enter_context(p.keyed(step))
            yield self

    def wire_out(self, x_BTD, pos_BT, sid_B, layer):
        p = self._part(layer)
        return p.wire_out(x_BTD, pos_BT, sid_B, layer) if p else (x_BTD,)

    def wire_in(self, wire, pos_BT, sid_B, layer, dtype):
        p = self._part(layer)
        return p.wire_in(wire, pos_BT, sid_B, layer, dtype) if p else wire[0]


def wire_bits(codec: Codec, tokens_per_micro: float = 1.0) -> tuple[float, float]:
    """(forward, backward) bytes per token at one compressed cut (a mix: the mean over all cuts)."""
    if isinstance(codec, MixCodec):
        per_cut = [wire_bits(p, tokens_per_micro) for p in codec.parts for _ in p.cuts]
        per_cut += [(2.0 * codec.d, 2.0 * codec.d)] * (len(codec.all_cuts) - len(per_cut))
        return tuple(sum(x) / len(per_cut) for x in zip(*per_cut))
    if isinstance(codec, SimCodec):
        return codec.bytes_per_token(codec.fwd_spec, tokens_per_micro), codec.bytes_per_token(codec.bwd_spec, tokens_per_micro)
    if codec.name == "prf":
        return 4.0 * codec.k, 4.0 * codec.k
    return tuple(float(v) for v in wire_format(codec.fwd, codec.back(), round(tokens_per_micro)))


def batch(run, model_dir: str):
    """One step's rollout: (ids, attn, sid, resp_NT1, adv_N, mean reward)."""
    from ds_twocircuit.data.synthetic import synthetic_splits
    from ds_twocircuit.data.verify import exact_integer
    g = run.tc.grpo
    train, _ = synthetic_splits(run.tc.data.eval_size)
    rows = train.shuffle(seed=run.tc.train.seed).select(range(g.prompts_per_step))
    gen = HFSampler(model_dir).generate(list(rows["problem"]), g.group_size, max_new_tokens=g.max_new_tokens,
                                        seed=run.tc.train.seed)
    answers = [a for a in rows["answer"] for _ in range(g.group_size)]
    rewards = torch.tensor([exact_integer(t, a) for t, a in zip(gen.texts, answers)], dtype=torch.float32)
    sid = torch.arange(gen.ids_NT.shape[0])
    return gen.ids_NT, gen.attn_NT, sid, gen.resp_NT1, group_advantages(rewards, g.group_size), float(rewards.mean())


def modules(model_dir: str, codec: Codec, split: list[int]) -> list:
    config = load_hf_config(model_dir, "sdpa")
    mods, embed = [], None
    for s in layer_specs(config, SafetensorsReader(model_dir), codec, split):
        if getattr(s, "key", None) == "embed" and embed is not None:
            mods.append(lambda h, e=embed: tied_head(e, h))
            continue
        mods.append(s.build())
        embed = mods[-1] if getattr(s, "key", None) == "embed" else embed
    return mods


def policy_gradient(mods, codec: Codec, b, micro: int, keep_cut_grads: list[int] = ()) -> tuple[torch.Tensor, dict]:
    """The flat gradient (float64) of the β = 0 GRPO loss at ρ = 1, summed over micro-batches of
    `micro` sequences as the pipeline runs them, and the cut activations' gradients (real tokens)."""
    ids, attn, sid, resp, adv, _ = b
    params = [p for m in mods if isinstance(m, torch.nn.Module) for p in m.parameters()]
    for p in params:
        p.grad = None
    cut_grads = {l: [] for l in keep_cut_grads}
    for rows in torch.arange(len(ids)).split(micro):
        cut_acts = {}
        x = (ids[rows], attn[rows], sid[rows])
        with codec.keyed(1):
            for m in mods:
                x = m(x)
                if getattr(m, "layer_idx", None) in cut_grads:
                    x[0].retain_grad()
                    cut_acts[m.layer_idx] = x[0]
        logp, _ = head_logprobs(x.h_BTD[:, :-1], x.weight_VD, ids[rows, 1:])
        loss, _ = grpo_token_loss(logp, logp.detach(), logp.detach(), adv[rows], resp[rows] / resp.sum(),
                                  LossCoefs(kl_coef=0.0))
        loss.backward()
        for l, act in cut_acts.items():
            cut_grads[l].append(act.grad[attn[rows].bool()].double())
    flat = torch.cat([p.grad.reshape(-1).double() for p in params])
    return flat, {l: torch.cat(g) for l, g in cut_grads.items()}


def spectra(cut_grads: dict[int, torch.Tensor]) -> None:
    print("\n| cut | tokens × d | energy in top 4 | top 16 | top 64 | stable rank |\n|---|---|---|---|---|---|")
    for layer, g in cut_grads.items():
        s2 = torch.linalg.svdvals(g) ** 2
        share = lambda r: float(s2[:r].sum() / s2.sum())
        print(f"| {layer} | {tuple(g.shape)} | {share(4):.3f} | {share(16):.3f} | {share(64):.3f} | "
              f"{float(s2.sum() / s2[0]):.1f} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="ds_configs/dense.json")
    ap.add_argument("--draws", type=int, default=4)
    ap.add_argument("--spectra", action="store_true")
    ap.add_argument("--variants", nargs="*", default=["prf19", "rot4/240x2", "rot2/240x2"])
    ap.add_argument("overrides", nargs="*", help="config overrides, e.g. model.embedded=wide")
    a = ap.parse_args()
    torch.manual_seed(0)
    run = load_config(a.recipe, a.overrides, world_size=8)
    split = list(run.tc.model.layers_per_stage)
    model_dir = base_model_dir(run.tc)
    b = batch(run, model_dir)
    d = load_hf_config(model_dir, "sdpa").hidden_size
    cuts = cut_layers(split)
    ntok = int(b[1].sum())
    print(f"model {model_dir} (d = {d}); {b[0].shape[0]} sequences, {ntok} real tokens, "
          f"{int(b[3].sum())} response tokens, mean reward {b[5]:.3f}, cuts {cuts}")
    dense_codec = Codec(d=d, cuts=cuts)
    micro = run.ds["train_micro_batch_size_per_gpu"]
    dense, cut_grads = policy_gradient(modules(model_dir, dense_codec, split), dense_codec, b, micro,
                                       cuts if a.spectra else ())
    if a.spectra:
        spectra(cut_grads)
    print("\n| variant | B/token fwd / bwd per cut | share of bf16 fwd+bwd | cos(G_comp, G_dense) per draw | mean | s per draw |\n"
          "|---|---|---|---|---|---|")
    tokens_per_micro = b[0].shape[1] * micro       # the padded (B_micro, T) block a factor spans
    for name in a.variants:
        cos, t0 = [], time.time()
        for seed in range(a.draws):
            codec = make_codec(name, d, cuts, seed, micro)
            g, _ = policy_gradient(modules(model_dir, codec, split), codec, b, micro)
            cos.append(float(g @ dense / (g.norm() * dense.norm())))
        fwd, bwd = wire_bits(make_codec(name, d, cuts, 0, micro), tokens_per_micro)
        share = (fwd + bwd) / (2 * 2 * d)
        print(f"| {name} | {fwd:.0f} / {bwd:.0f} | {100 * share:.1f} % | {' '.join(f'{c:.2f}' for c in cos)} | "
              f"{sum(cos) / len(cos):.3f} | {(time.time() - t0) / a.draws:.0f} |", flush=True)


if __name__ == "__main__":
    main()
