"""The real deployment on paper, from what was measured here: seconds per step of Qwen2.5-1.5B on 8
GPU stages at 100 Mbit/s and 1 Gbit/s, per codec, and which term dominates.

    python launch/projection.py [--beta 3.03 --bench-m 4] [--sync-ratio R] [--anchor-every C]
                                [--anchor compute-matched|full] [--ref sampler] [--prompt-share S
                                --share-prompts] [--skipped-share Z] [--gen-tokens-per-s T
                                --sampler-gpus G] ...

The workload is a GRPO step at deployment scale: 512 prompts × 8 samples, bf16 activations, P = 1.54 B
parameters, S = 8 stages on H100s at 40 % MFU. N, the token slots a pass computes and sends, comes
from a drawn batch (pipeline/layout.py `long_tailed_spans`: responses log-normal with σ = 1 and mean
--response-mean under --response-cap, the math runs' 550 under 3072; prompts uniform over
--prompt-len) laid out as the pipeline would (--layout): `trimmed`, micro-batches of --micro cut by
length (what `train.trim_micro_batches=auto` picks for such a batch), `padded`, every sequence as
long as the batch's longest, or `full`, every sequence --tokens long (N = 16.8 M, the former
assumption). Per step:

    compute      (2·P·N_ref + 6·P·N_upd) / (S·F·mfu)   the reference pass and the update, on S devices
    boundaries   β(M)·B/r                      B: bytes one cut carries per step over its passes
                                               (reference forward, train forward, train backward),
                                               each pass's tokens × the codec's bytes per token and
                                               direction (below); r: the link's rate
    ref          4·N_resp/r                    with the reference beside the sampler (--ref sampler):
                                               one float per response token to the last stage, and no
                                               reference pass in the pipeline (its compute moves to
                                               the sampler's side, off this sum)

    sync         ρ·2P/r                        the sampler's weights; ρ = 1 whole, the measured delta
                                               ratio with the lossless delta sync (sync/weight_sync.py)
    anchor       (θ + batch + P/8) per fire / c   θ as a delta (ρ_c: ratio after c steps of movement),
                                               the replayed batch (ids, masks, sampler log-probs: 24
                                               bytes per token), sign(M) back

The exact savings, as inputs (measured on the task at hand, not guessed): --prompt-share, the
share of a sequence's tokens that are prompt; with --share-prompts a cut carries a group's prompt
once, so a pass's tokens are N·(s/G + 1 − s); --skipped-share, the share of groups with all-equal
rewards, left out of the update (β = 0 only: then there is no reference pass either).

Bytes per token and cut, per pass (checked against bench_links.py's p2p counts at d = 1536: dense
18 432, prf 924, rotated 1 782 bytes per token over the three passes in fp32): dense d·2; prf95
77·2 (bf16 payload); rotated 770 forward (4 bits on all 1536 rotated coordinates + a 2-byte
scale), 242 back (2 bits on 960); frontier (`frontier_wide.json`) 410 forward (2-bit Gaussian levels
on all 1536 rotated coordinates, an 8-bit scale per 64 and a 2-byte token scale), and back each
micro-batch's rank-2 code, bf16 factors P (n × 2) and Q (d × 2) for its n tokens: 4·(1 + d/n) per
token (4.4 at the workload's n = 16 384; the codec's own time, a randomized SVD per micro-batch and
cut, is not in this sum: see bench_codec.py). The frontier recipe has β = 0, so it runs no reference
pass and needs no reference log-probs, whatever --ref says; and its rank-coded backward does not
run with shared prompts (the config refuses the pair), so --share-prompts leaves it unchanged.

β(M), the cut transfers on the critical path, is what bench_links.py fits at its M micro-batches,
carried to the workload's M by a flow shop's (M + S − 2)/M (each pass's M micro-batches cross S − 1
links in a chain; `--overlap` in bench_links.py measures how β follows M). Two totals: serial, the
sum of the terms (DeepSpeed's blocking sends leave transfer and compute in series on each stage),
and overlapped, max(compute, boundaries) + sync + anchor (transfers hidden behind compute, the
most non-blocking sends or a deeper schedule could give).

Generation, a second table: the dense sampler on its own --sampler-gpus H100s (vLLM, bf16) generates
the step's response tokens at --gen-tokens-per-s each (prefill left out: prompts are a tenth of the
tokens and run at many times the decode rate). The assumption, 12 500 output tokens/s per H100, is
vLLM's measured throughput for Llama-3.1-8B in bf16 on one H100 (third-party benchmarks collected at
morphllm.com/vllm-benchmarks, 2026), taken as a floor for 1.5B: a decode step of Qwen2.5-1.5B reads
about a fifth of the weight bytes and a quarter of the KV bytes per token; the table also shows 4×
that rate. With the training step's serial time `train` (compute, boundaries, reference, anchor) and
the weight sync's transfer `sync`:

    sync   gen + train + sync                  rollout.staleness = 0: generate, train, then sync
    async  sync + max(gen, train)              rollout.staleness ≥ 1: the sampler generates step
                                               t+1+k's batch from θ_{t+1} while the pipeline trains
                                               step t+1; the sync, which both wait for, is on the path

The anchor is bounded by compute, not bytes: one device replaying a whole batch densely takes
(S / anchor devices) × the step's compute, so its cadence c cannot be below S/A. The compute-matched
anchor fires every step on a keyed 1/c share of the batch: the same compute, a sign one step old,
θ as a one-step delta, P/8 bytes back every step.
"""
import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

KEEP, D, FWD_ROT, BWD_ROT, FWD_FRONTIER, RANK_FRONTIER = 77, 1536, 770, 242, 410, 2
CODECS = ("dense", "prf95", "rotated", "frontier")
# what each codec's recipe runs besides its code: the frontier's β is 0 (no KL term), its rank code
# does not run with shared prompts (the config refuses the pair), and only prf95 and rotated project
# an anchor
NO_KL, NO_SHARED_PROMPTS, ANCHORED = {"frontier"}, {"frontier"}, {"prf95", "rotated"}


def bytes_per_token(codec: str, micro_tokens: float) -> tuple[float, float]:
    """Bytes one cut carries per token (forward, backward), bf16 activations, micro-batches of
    `micro_tokens` tokens (the rank code's Q factor is shared by a micro-batch's tokens)."""
    rank_back = 2 * RANK_FRONTIER * (1 + D / micro_tokens)
    return {"dense": (D * 2, D * 2), "prf95": (KEEP * 2, KEEP * 2), "rotated": (FWD_ROT, BWD_ROT),
            "frontier": (FWD_FRONTIER, rank_back)}[codec]


def workload(a) -> tuple[float, float]:
    """(N, the token slots one pass computes and sends; the response tokens) of a step's batch under
    a.layout."""
    if a.layout == "full":
        n = a.prompts * a.samples * a.tokens
        return n, n * (1 - a.prompt_share)
    from ds_twocircuit.pipeline.layout import long_tailed_spans, padded_layout, trimmed_layout
    span, T, P = long_tailed_spans(a.prompts, a.samples, a.response_mean, a.response_cap, tuple(a.prompt_len))
    lay = trimmed_layout(span, T, a.micro, 1) if a.layout == "trimmed" else padded_layout(len(span), T, a.micro)
    return float(lay.positions()), float((span[:, 1] - P).sum())


def pass_tokens(a, codec: str) -> tuple[float, float, float]:
    """(tokens of the reference forward on the wire, of each update pass, response tokens) per step."""
    n, resp = a.n, a.resp
    shared = a.share_prompts and codec not in NO_SHARED_PROMPTS
    crossing = n * (a.prompt_share / a.samples + 1 - a.prompt_share) if shared else n
    update = crossing * (1 - a.skipped_share)
    return crossing if reference_pass(a, codec) else 0.0, update, resp


def has_kl(a, codec: str) -> bool:
    """Whether the step has a KL term, so reference log-probs: not at β = 0 (skipping needs it, and
    a recipe of NO_KL has it)."""
    return not a.skipped_share and codec not in NO_KL


def reference_pass(a, codec: str) -> bool:
    """Whether the pipeline runs a reference pass: a KL term, its log-probs not beside the sampler."""
    return a.ref == "pipeline" and has_kl(a, codec)


def flow_shop(m: int, stages: int) -> float:
    return (m + stages - 2) / m


def terms(codec: str, rate_bps: float, a) -> dict[str, float]:
    r = rate_bps / 8
    n = a.n
    ref, upd, resp = pass_tokens(a, codec)
    n_ref = n if reference_pass(a, codec) else 0.0    # compute: sharing saves bytes, not FLOPs
    compute = (2 * n_ref + 6 * n * (1 - a.skipped_share)) * a.params / (a.stages * a.gpu_flops * a.mfu)
    beta = a.beta * flow_shop(a.m, a.stages) / flow_shop(a.bench_m, a.stages)
    fwd, bwd = bytes_per_token(codec, n / a.m)
    out = {"compute": compute, "boundaries": beta * (fwd * (ref + upd) + bwd * upd) / r,
           "ref": 4 * resp / r if a.ref == "sampler" and has_kl(a, codec) else 0.0,
           "sync (whole)": 2 * a.params / r, "sync (delta)": a.sync_ratio * 2 * a.params / r, "anchor": 0.0}
    if codec in ANCHORED:
        c, share = (a.anchor_every, 1.0) if a.anchor == "full" else (1, 1 / a.anchor_every)
        theta = (a.anchor_theta_ratio if a.anchor == "full" else a.sync_ratio) * 2 * a.params
        out["anchor"] = (theta + 24 * n * share + a.params / 8) / c / r
    return out


def table(a) -> str:
    lines = ["| link | codec | compute | boundaries β·B/r | sync whole / delta | anchor | total serial (× compute) | "
             "total overlapped (× compute) | dominant |", "|---|---|---|---|---|---|---|---|---|"]
    for name, bps in (("100 Mbit/s", 100e6), ("1 Gbit/s", 1e9)):
        for codec in CODECS:
            t = terms(codec, bps, a)
            sync = t["sync (delta)"]
            serial = t["compute"] + t["boundaries"] + t["ref"] + sync + t["anchor"]
            overlapped = max(t["compute"], t["boundaries"]) + t["ref"] + sync + t["anchor"]
            parts = {"compute": t["compute"], "boundaries": t["boundaries"], "sync": sync, "anchor": t["anchor"]}
            lines.append(f"| {name} | {codec} | {t['compute']:.0f} | {t['boundaries']:.0f} | "
                         f"{t['sync (whole)']:.1f} / {sync:.1f} | {t['anchor']:.1f} | {serial:.0f} "
                         f"({serial / t['compute']:.2f}) | {overlapped:.0f} ({overlapped / t['compute']:.2f}) | "
                         f"{max(parts, key=parts.get)} |")
    return "\n".join(lines)


def generation_table(a) -> str:
    """Seconds per step with generation in it, sync against async (module docstring), per link, codec
    and sampler throughput."""
    lines = ["| link | codec | sampler tokens/s | generate | train (serial) | sync | step, sync | step, async | "
             "async gain |", "|---|---|---|---|---|---|---|---|---|"]
    for name, bps in (("100 Mbit/s", 100e6), ("1 Gbit/s", 1e9)):
        for codec in CODECS:
            t = terms(codec, bps, a)
            train, sync = t["compute"] + t["boundaries"] + t["ref"] + t["anchor"], t["sync (delta)"]
            for rate in (a.gen_tokens_per_s, 4 * a.gen_tokens_per_s):
                gen = a.resp / (rate * a.sampler_gpus)
                step_sync, step_async = gen + train + sync, sync + max(gen, train)
                lines.append(f"| {name} | {codec} | {rate * a.sampler_gpus:,.0f} | {gen:.0f} | {train:.0f} | {sync:.1f} | "
                             f"{step_sync:.0f} | {step_async:.0f} | {step_sync / step_async:.2f}× |")
    return "\n".join(lines)


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--beta", type=float, default=3.03, help="β fitted by bench_links.py (dense, its M)")
    ap.add_argument("--bench-m", type=int, default=4, help="micro-batches per step of that fit")
    ap.add_argument("--m", type=int, default=1024, help="the workload's micro-batches per step (4096 sequences / 4)")
    ap.add_argument("--sync-ratio", type=float, default=0.046, help="delta sync bytes / whole bf16 bytes per step "
                    "(measured: 0.046 on the 1536-wide stand-in at lr 1e-6, notebooks/delta_fraction.py)")
    ap.add_argument("--anchor-theta-ratio", type=float, default=1.0, help="θ delta bytes / whole after c steps")
    ap.add_argument("--anchor-every", type=int, default=8, help="c; at least stage devices / anchor devices")
    ap.add_argument("--anchor", choices=["compute-matched", "full"], default="compute-matched",
                    help="every step on a 1/c share (the 1.5B recipe), or a full replay every c steps")
    ap.add_argument("--ref", choices=["pipeline", "sampler"], default="pipeline",
                    help="where the reference log-probs are computed (grpo.ref_logprobs)")
    ap.add_argument("--prompt-share", type=float, default=0.0, help="share of a sequence's tokens that are prompt")
    ap.add_argument("--share-prompts", action="store_true", help="a cut carries a group's prompt once (grpo.share_prompts)")
    ap.add_argument("--skipped-share", type=float, default=0.0,
                    help="share of groups left out of the update (grpo.skip_zero_advantage, β = 0)")
    ap.add_argument("--params", type=float, default=1.54e9)
    ap.add_argument("--prompts", type=int, default=512)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=4096, help="every sequence's length with --layout full")
    ap.add_argument("--layout", choices=["trimmed", "padded", "full"], default="trimmed")
    ap.add_argument("--response-mean", type=float, default=550.0)
    ap.add_argument("--response-cap", type=int, default=3072)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=[60, 320])
    ap.add_argument("--micro", type=int, default=4, help="sequences per micro-batch (the 1.5B recipe's)")
    ap.add_argument("--stages", type=int, default=8)
    ap.add_argument("--gpu-flops", type=float, default=989e12)
    ap.add_argument("--mfu", type=float, default=0.4)
    ap.add_argument("--gen-tokens-per-s", type=float, default=12500.0,
                    help="the sampler's output tokens/s per GPU (vLLM, bf16; the module docstring's source)")
    ap.add_argument("--sampler-gpus", type=int, default=1, help="GPUs generating side by side (data-parallel vLLM)")
    a = ap.parse_args(argv)
    a.n, a.resp = workload(a)    # the drawn batch's token slots a pass and response tokens
    return a


def main(argv=None) -> None:
    a = parse(argv)
    seqs = a.prompts * a.samples
    print(f"{a.layout}: N = {a.n / 1e6:.2f} M token slots a pass ({a.n / seqs:.0f} a sequence), "
          f"{a.resp / 1e6:.2f} M response tokens ({a.resp / seqs:.0f} a sequence)\n")
    print(table(a))
    print(f"\nWith generation: {a.resp / 1e6:.2f} M response tokens a step on {a.sampler_gpus} sampler GPU(s)\n")
    print(generation_table(a))


if __name__ == "__main__":
    main()
