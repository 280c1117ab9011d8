"""The bytes-vs-learning frontier from the 100-step runs under runs/readme/.

    python notebooks/frontier_table.py [runs/readme]

Per run: mean grad/cos_comp_dense over the probe steps, the step-1 gap, held-out accuracy at every
evaluation, and the wire bytes per step, boundaries (p2p, both directions, every pass) plus the
anchor link (θ and the batch up, the sign down), as a fraction of the dense control's boundary
bytes per step. The dense control is fp32; a bf16 pipeline's dense payloads are half as large while
b-bit codes are not, so the same run is about twice that fraction of a bf16 control (the last column:
the row descriptors and shape messages that do not halve are under 1 % of the dense bytes).
"""
import json
import pathlib
import statistics
import sys

ROOT = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "runs/readme")
RUNS = {"dense": "dense (control)", "prf95": "PRF 5 % + anchor c = K = 1 (prf95.json)",
        "prf95_noanchor": "PRF 5 %, no anchor", "prf95_c20": "PRF 5 % + anchor c = K = 20",
        "rot4_noanchor": "rotated fwd 64 × 4-bit (34 B) / bwd 40 × 2-bit (12 B), no anchor",
        "rot3_noanchor": "rotated fwd 64 × 3-bit (26 B) / bwd 40 × 2-bit, no anchor",
        "rot2_noanchor": "rotated fwd 64 × 2-bit (18 B) / bwd 40 × 2-bit, no anchor",
        "rot6_noanchor": "rotated fwd 64 × 6-bit (50 B) / bwd 40 × 2-bit, no anchor",
        "rot8_noanchor": "rotated fwd 64 × 8-bit (66 B) / bwd 40 × 2-bit, no anchor",
        "rot4b4_noanchor": "rotated fwd 64 × 4-bit / bwd 64 × 4-bit (34 B both ways), no anchor",
        "rot4_c20f": "rotated 34 B / 12 B + anchor c = K = 20, forecast",
        "rot4_c1": "rotated 34 B / 12 B + anchor c = K = 1",
        "dense_s1": "seed 1: dense (control)",
        "prf95_s1": "seed 1: PRF 5 % + anchor c = K = 1 (prf95.json)",
        "rot4_noanchor_s1": "seed 1: rotated 34 B / 12 B, no anchor",
        "rot8_noanchor_s1": "seed 1: rotated 66 B / 12 B, no anchor"}


def rows(run: str, name: str = "metrics.jsonl") -> list[dict]:
    path = ROOT / run / name
    return [json.loads(l) for l in path.read_text().splitlines() if l.strip()] if path.is_file() else []


def wire(r: list[dict]) -> float:
    return statistics.mean(x["codec/bytes_fwd"] + x["codec/bytes_bwd"] + x.get("anchor/bytes", 0.0) for x in r)


def main():
    dense = wire(rows("dense"))
    # share of the gain of the dense control of the same seed (runs named *_s1 against dense_s1)
    seed = lambda run: "_s1" if run.endswith("_s1") else ""
    gains = {s: (lambda ev: ev[-1]["acc"] - ev[0]["acc"] if ev else float("nan"))(rows("dense" + s, "eval.jsonl"))
             for s in ("", "_s1")}
    print("| run | cos(G_comp, G_dense) | gap at step 1 | held-out acc (0, 20, …, 100) | share of dense's gain "
          "| wire / dense fp32 | wire / dense bf16 |\n|---|---|---|---|---|---|---|")
    for run, label in RUNS.items():
        r, ev = rows(run), rows(run, "eval.jsonl")
        if not r or len(ev) < 6:
            continue
        cos = statistics.mean(x["grad/cos_comp_dense"] for x in r if "grad/cos_comp_dense" in x)
        share = (ev[-1]["acc"] - ev[0]["acc"]) / gains[seed(run)]
        print(f"| {label} | {cos:.3f} | {r[0]['rollout_corr/kl']:.3g} | " + " / ".join(f"{e['acc']:.3f}" for e in ev) +
              f" | {share:.2f} | {wire(r) / dense:.3f} | {2 * wire(r) / dense:.3f} |")


if __name__ == "__main__":
    main()
