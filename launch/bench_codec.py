"""Codec micro-benchmark: PRF encode+decode against a plain dense copy of the same activation.

    python launch/bench_codec.py [--tokens 8192] [--threads 1] [--widths 1536 64]

For each width d (the reference's 1536 and the embedded default's 64) at keep k = round(0.05·d),
on one activation tensor x of (tokens, d) fp32, times with `torch.utils.benchmark` (median of
blocked runs): a dense copy of x (what an uncompressed boundary costs locally before the wire),
mask generation alone (the PRF's kept sets for every token), encode (mask + gather), decode
(mask + scatter + scale), and prints each as a ratio to the dense copy, side by side in one run.
One thread by default, as each pipeline rank runs on CPU here.
"""
import argparse

import torch
from torch.utils.benchmark import Timer

from ds_twocircuit.codec import prf
from ds_twocircuit.codec.boundary import Codec
from ds_twocircuit.codec.geometry import keep_count


def bench(stmt: str, env: dict) -> float:
    return Timer(stmt, globals=env).blocked_autorange(min_run_time=1.0).median


def run_width(d: int, tokens: int, seq: int = 512) -> dict:
    k = keep_count(0, 0.05, d)
    B = max(1, tokens // seq)
    x = torch.randn(B, seq, d)
    pos, sid = torch.arange(seq).expand(B, seq), torch.arange(B)
    c = Codec(name="prf", d=d, k=k, seed=0, cuts={0})
    with c.keyed(1):
        y = c.encode(x, pos, sid, 0)
        env = dict(x=x, y=y, c=c, pos=pos, sid=sid, prf=prf, d=d, k=k, torch=torch)
        t = {
            "dense copy": bench("x.clone()", env),
            "mask generation": bench("prf.kept_for(0, 0, 1, sid, pos, d, k)", env),
            "encode": bench("c.encode(x, pos, sid, 0)", env),
            "decode": bench("c.decode(y, pos, sid, 0, torch.float32)", env),
        }
    t["encode+decode"] = t["encode"] + t["decode"]
    return {"d": d, "k": k, "tokens": B * seq, "times": t}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--widths", type=int, nargs="+", default=[1536, 64])
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    print(f"threads={a.threads} tokens={a.tokens}  (ratios: time / dense copy of the same tensor)")
    print(f"{'d':>5} {'k':>4} | {'dense copy ms':>13} | {'mask gen':>9} {'encode':>8} {'decode':>8} {'enc+dec':>8} | mask rate")
    for d in a.widths:
        r = run_width(d, a.tokens)
        t = r["times"]
        base = t["dense copy"]
        rate = r["tokens"] / t["mask generation"]
        print(f"{d:>5} {r['k']:>4} | {base * 1e3:>13.3f} | {t['mask generation'] / base:>8.1f}x {t['encode'] / base:>7.1f}x "
              f"{t['decode'] / base:>7.1f}x {t['encode+decode'] / base:>7.1f}x | {rate / 1e6:.2f} M tokens/s, "
              f"{rate * r['k'] / 1e6:.1f} M indices/s")


if __name__ == "__main__":
    main()
