"""Answers per second of rank 0's math-verify pool at 1 and more workers, side by side.

    python launch/bench_verify.py [--answers 1024] [--workers 1 2] [--timeout 5]

The answers are MATH-style responses of every form math-verify compares (launch/make_fixtures.py's
templates: integers, fractions, polynomial expansions, intervals, radicals, pairs, remainders),
each a worked solution ending in `\\boxed{}`, half scored against their own answer and half against a
neighbour's (a miss costs math-verify more than a hit). Each worker count scores the same list
after its helpers have started (a step's pool lives for the whole run); the scores must agree.
"""
import argparse
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--answers", type=int, default=1024)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--timeout", type=float, default=5.0)
    a = ap.parse_args()
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from make_fixtures import math_rows

    from ds_twocircuit.data.math_verifier import MathVerifier
    rows = math_rows(a.answers + 1, seed=0)
    responses = [r["solution"] for r in rows[:-1]]
    answers = [r["answer"] if i % 2 == 0 else rows[i + 1]["answer"] for i, r in enumerate(rows[:-1])]
    print(f"{a.answers} answers, limit {a.timeout} s each")
    print(f"{'workers':>7} {'seconds':>8} {'answers/s':>10} {'correct':>8}")
    first = None
    for w in a.workers:
        v = MathVerifier(a.timeout, workers=w)
        try:
            v.many(responses[:w], answers[:w])             # start the helpers, untimed
            t0 = time.perf_counter()
            scores = v.many(responses, answers)
            took = time.perf_counter() - t0
        finally:
            v.close()
        first = first or scores
        assert scores == first, "the pool changed a score"
        print(f"{w:>7} {took:>8.2f} {a.answers / took:>10.1f} {sum(scores):>8.0f}")


if __name__ == "__main__":
    main()
