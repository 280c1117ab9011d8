"""Seconds to read a step's sampled-token log-probs out of vLLM's outputs, per token dicts against flat lists.

    python launch/bench_vllm_logprobs.py [--samples 4096] [--mean-len 550] [--cap 3072]

A step of the reference recipe returns 512 × 8 samples; their response lengths here are long-tailed
(log-normal with σ = 1 and the given mean, cut at the cap: a few reach it, most are short). Both
layouts are vLLM's own classes, filled as its output processor fills them for `logprobs=0`: a list
of {token: Logprob} per position (`flat_logprobs=False`, what the sampler read token by token) and
`FlatLogprobs` (what it reads now, one slice per sample). Timed side by side: building each layout
per position (vLLM's side, a stand-in for its output processor's work) and the sampler's reading.
"""
import argparse
import math
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=4096)
    ap.add_argument("--mean-len", type=float, default=550)
    ap.add_argument("--cap", type=int, default=3072)
    a = ap.parse_args()
    from vllm.logprobs import FlatLogprobs, Logprob

    from ds_twocircuit.sampler.vllm import sampled_logprobs
    rng = np.random.default_rng(0)
    lengths = np.minimum(a.cap, np.maximum(1, rng.lognormal(math.log(a.mean_len) - 0.5, 1.0, a.samples).round())).astype(int)
    raw = [(rng.integers(0, 151_936, n).tolist(), (-rng.exponential(1.0, n)).tolist()) for n in lengths]
    t0 = time.perf_counter()
    all_dicts = [[{t: Logprob(lp, 1, None)} for t, lp in zip(toks, lps)] for toks, lps in raw]
    b_old = time.perf_counter() - t0
    t0 = time.perf_counter()
    flats = []
    for toks, lps in raw:
        flat = FlatLogprobs()
        for t, lp in zip(toks, lps):
            flat.append_fast([t], [lp], iter([1]), [None])
        flats.append(flat)
    b_new = time.perf_counter() - t0
    samples = [(toks, d, f) for (toks, _), d, f in zip(raw, all_dicts, flats)]
    t0 = time.perf_counter()
    old = [[lp[t].logprob for t, lp in zip(toks, dicts)] for toks, dicts, _ in samples]
    t_old = time.perf_counter() - t0
    t0 = time.perf_counter()
    new = [sampled_logprobs(flat, toks) for toks, _, flat in samples]
    t_new = time.perf_counter() - t0
    assert new == old
    print(f"{a.samples} samples, {lengths.sum()} tokens (mean {lengths.mean():.0f}, max {lengths.max()}, "
          f"{(lengths == a.cap).sum()} at the cap)")
    print(f"vLLM's side, built per position: per-token dicts {b_old:.2f} s   flat {b_new:.2f} s")
    print(f"the sampler's read:               per-token dicts {t_old:.3f} s   flat {t_new:.4f} s   ({t_old / t_new:.1f}× faster)")


if __name__ == "__main__":
    main()
