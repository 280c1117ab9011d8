"""Peak host memory of the last stage's log-probs, whole-vocabulary logits against chunks from the head.

    python launch/bench_logprob_memory.py [--tokens 1024 4096] [--hidden 1536] [--vocab 151936] [--dtype bf16]

One forward and backward of the GRPO loss's log-probs (and the entropy, no gradient) of `tokens`
positions at the reference width and vocabulary, from the final hidden states and the head's weight:
`whole` makes the (tokens, V) logits and takes `token_logprobs` of them, as the pipeline did;
`chunked` is `head_logprobs` (grpo/logprobs.py). Each measurement runs in a fresh process and reports
its peak resident memory above what it held once its inputs (h, W, targets) existed, in GiB and in
units of one fp32 (tokens, V) copy. The chunked way's backward holds one fixed fp32 (V, D) sum of
W's gradient (0.87 GiB at the reference shape) beside a chunk's transients; the whole way's cost grows
with the tokens. Both orders of the same two functions, side by side in one
invocation: read the ratio, not the absolute numbers (the allocator's high-water mark).
"""
import argparse
import json
import resource
import subprocess
import sys

GiB = 2 ** 30


def rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def measure(way: str, tokens: int, hidden: int, vocab: int, dtype: str) -> dict:
    import torch
    import torch.nn.functional as F

    from ds_twocircuit.grpo.logprobs import head_logprobs, token_logprobs
    torch.manual_seed(0)
    dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    # made in their dtype (no fp32 transient to lift the high-water mark before the measurement)
    h = torch.randn(1, tokens, hidden, dtype=dt).mul_(0.1).requires_grad_()
    w = torch.randn(vocab, hidden, dtype=dt).mul_(0.02).requires_grad_()
    targets = torch.randint(vocab, (1, tokens))
    base = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, rss_now())
    if way == "whole":
        logp, entropy = token_logprobs(F.linear(h, w), targets, 0.7)
    else:
        logp, entropy = head_logprobs(h, w, targets, 0.7)
    (logp.sum() + 0 * entropy.sum()).backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    one = tokens * vocab * 4
    return {"way": way, "tokens": tokens, "peak_GiB": (peak - base) / GiB, "fp32_copies": (peak - base) / one,
            "one_fp32_copy_GiB": one / GiB}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--ways", nargs="+", default=["whole", "chunked"])
    ap.add_argument("--one", nargs=2, help=argparse.SUPPRESS)        # WAY TOKENS: measure in this process
    a = ap.parse_args()
    if a.one:
        print(json.dumps(measure(a.one[0], int(a.one[1]), a.hidden, a.vocab, a.dtype)))
        return
    print(f"hidden {a.hidden}, vocabulary {a.vocab}, {a.dtype} hidden states and head; peak above the inputs")
    print(f"{'tokens':>7} {'way':>8} {'peak GiB':>9} {'fp32 (T,V) copies':>18}")
    for tokens in a.tokens:
        for way in a.ways:
            out = subprocess.run([sys.executable, __file__, "--one", way, str(tokens), "--hidden", str(a.hidden),
                                  "--vocab", str(a.vocab), "--dtype", a.dtype], capture_output=True, text=True)
            if out.returncode:
                print(f"{tokens:>7} {way:>8} failed: {out.stderr.strip().splitlines()[-1:]}")
                continue
            r = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"{tokens:>7} {way:>8} {r['peak_GiB']:>9.2f} {r['fp32_copies']:>18.2f}")


if __name__ == "__main__":
    main()
