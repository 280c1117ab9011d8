"""Codec micro-benchmark: encode + decode of each codec against a plain dense copy of the same tensor.

    python launch/bench_codec.py [--tokens 8192] [--threads 1] [--widths 1536 64]

For each width d (the reference's 1536 and the embedded default's 64), on one activation tensor x of
(tokens, d) fp32, times with `torch.utils.benchmark` (median of blocked runs), side by side in one
run, each as a ratio to a dense copy of x (what an uncompressed boundary costs locally before the
wire):
- PRF at keep k = round(0.05·d): mask generation alone (the kept sets for every token), encode
  (mask + gather), decode (mask + scatter + scale);
- the rotated codec at the frontier's budgets (forward all d coordinates at 4 bits, backward 5/8 of
  them at 2 bits, as `codec.fwd_bits=4 codec.bwd_coords=… codec.bwd_bits=2`): key generation (the
  per-token keys every other step derives from), forward encode and decode, backward encode and
  decode (of a gradient of the same shape);
- the frontier recipe's (`frontier_wide.json`): forward 2-bit Gaussian levels on all d coordinates
  with an 8-bit scale per 64, backward the rank-2 code of the whole (tokens, d) gradient as one
  micro-batch (a randomized SVD: ITERS power iterations, then an SVD of the small projection).
One thread by default, as each pipeline rank runs on CPU here.
"""
import argparse

import torch
from torch.utils.benchmark import Timer

from ds_twocircuit.codec import prf, rank_code, rotated
from ds_twocircuit.codec.boundary import Codec
from ds_twocircuit.codec.geometry import keep_count


def bench(stmt: str, env: dict) -> float:
    return Timer(stmt, globals=env).blocked_autorange(min_run_time=1.0).median


def activation(d: int, tokens: int, seq: int = 512):
    """x (B, seq, d) and its tokens' positions and sequence ids."""
    B = max(1, tokens // seq)
    return torch.randn(B, seq, d), torch.arange(seq).expand(B, seq), torch.arange(B)


def run_prf(d: int, tokens: int) -> dict:
    k = keep_count(0, 0.05, d)
    x, pos, sid = activation(d, tokens)
    c = Codec(name="prf", d=d, k=k, seed=0, cuts={0})
    with c.keyed(1):
        y = c.encode(x, pos, sid, 0)
        env = dict(x=x, y=y, c=c, pos=pos, sid=sid, prf=prf, d=d, k=k, torch=torch)
        t = {"dense copy": bench("x.clone()", env),
             "keys": bench("prf.kept_for(0, 0, 1, sid, pos, d, k)", env),
             "encode": bench("c.encode(x, pos, sid, 0)", env),
             "decode": bench("c.decode(y, pos, sid, 0, torch.float32)", env)}
    return {"codec": f"prf k={k}", "d": d, "tokens": x.shape[0] * x.shape[1], "times": t}


def time_rotated(d: int, tokens: int, fwd: rotated.Budget, name: str, back_encode: str, back_decode: str,
                 **names) -> dict:
    """Keys, the forward's rotated encode and decode, and the backward's code of a gradient g of the
    same shape: `back_encode` (→ yb) and `back_decode` are statements over g, yb, keys, d and `names`."""
    x, pos, sid = activation(d, tokens)
    xs, g = x.reshape(-1, d), torch.randn(x.numel() // d, d)
    keys = prf.token_keys(0, 0, 1, sid[:, None], pos).reshape(-1)
    env = dict(x=x, xs=xs, g=g, keys=keys, fwd=fwd, d=d, pos=pos, sid=sid, prf=prf, rotated=rotated,
               rank_code=rank_code, **names)
    env["yf"], env["yb"] = rotated.encode(xs, keys, fwd, "fwd"), eval(back_encode, env)
    t = {"dense copy": bench("x.clone()", env),
         "keys": bench("prf.token_keys(0, 0, 1, sid[:, None], pos)", env),
         "encode": bench("rotated.encode(xs, keys, fwd, 'fwd')", env),
         "decode": bench("rotated.decode(yf, keys, fwd, 'fwd')", env),
         "encode bwd": bench(back_encode, env),
         "decode bwd": bench(back_decode, env)}
    return {"codec": f"{name} ({fwd.bytes_per_token}/{env['yb'].shape[1]} B)", "d": d, "tokens": xs.shape[0],
            "times": t}


def run_rotated(d: int, tokens: int) -> dict:
    fwd, bwd = rotated.Budget(d, d, 4), rotated.Budget(d, d * 5 // 8, 2)
    return time_rotated(d, tokens, fwd, f"rotated {fwd.m}x{fwd.bits}/{bwd.m}x{bwd.bits}",
                        "rotated.encode(g, keys, bwd, 'bwd')", "rotated.decode(yb, keys, bwd, 'bwd')", bwd=bwd)


def run_frontier(d: int, tokens: int, rank: int = 2) -> dict:
    return time_rotated(d, tokens, rotated.Budget(d, d, 2, 64, "gauss"), f"frontier {d}x2 gauss t64/rank {rank}",
                        "rank_code.encode(g, rank, 0)", "rank_code.decode(yb, d, rank)", rank=rank)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--widths", type=int, nargs="+", default=[1536, 64])
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    print(f"threads={a.threads} tokens={a.tokens}  (ratios: time / dense copy of the same tensor; "
          "bwd columns: the backward direction's code of a gradient, rotated only)\n")
    print("| d | codec | dense copy ms | keys | encode | decode | enc+dec | bwd enc+dec | M tokens/s enc+dec |")
    print("|---|---|---|---|---|---|---|---|---|")
    for d in a.widths:
        for r in (run_prf(d, a.tokens), run_rotated(d, a.tokens), run_frontier(d, a.tokens)):
            t = r["times"]
            base, both = t["dense copy"], t["encode"] + t["decode"]
            bwd = f"{(t['encode bwd'] + t['decode bwd']) / base:.1f}x" if "encode bwd" in t else "–"
            print(f"| {d} | {r['codec']} | {base * 1e3:.3f} | {t['keys'] / base:.1f}x | {t['encode'] / base:.1f}x | "
                  f"{t['decode'] / base:.1f}x | {both / base:.1f}x | {bwd} | {r['tokens'] / both / 1e6:.2f} |")


if __name__ == "__main__":
    main()
