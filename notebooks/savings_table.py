"""The exact savings on the embedded default, from the 100-step runs under runs/readme/.

    python notebooks/savings_table.py [runs/readme]

Two tables. Bytes: per run, the mean per step over its 100 steps of the p2p bytes on every cut by
direction (KB, forward / backward, every pass), their sum, the reference log-probs sent beside the
pipeline, the anchor link, and the whole as a share of the dense control's boundary bytes (fp32,
β = 0.001, the same seed). Learning: held-out accuracy every 20 steps, the share of the same seed's
dense gain, the compressed gradient's mean cosine with the dense one at the probe steps, the
step-1 gap (sampler vs trainer KL), and the share of groups with all-equal rewards (left out of the
update where skipping).
"""
import json
import pathlib
import statistics
import sys

ROOT = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "runs/readme")
RUNS = {"dense": "dense, β = 0.001 (control)",
        "dense_b0_skip": "dense, β = 0, zero-advantage groups skipped",
        "prf95": "prf95 (PRF 5 % + anchor c = K = 1), ref in the pipeline",
        "prf95_refs": "prf95, ref beside the sampler",
        "rot4_noanchor": "rotated.json, ref in the pipeline",
        "rot4_refs": "rotated.json, ref beside the sampler",
        "rot4_b0_skip": "rotated.json, β = 0, zero-advantage groups skipped",
        "rot4_share": "rotated.json, shared prompts",
        "rot4_all": "rotated.json, β = 0, skipped groups, shared prompts",
        "dense_all": "dense, β = 0, skipped groups, shared prompts",
        "frontier_tiny": "frontier_wide.json's codec (2-bit Gaussian levels, rank-2 backward, β = 0)"}
RUNS.update({k + "_s1": "seed 1: " + v for k, v in list(RUNS.items())})


def rows(run: str, name: str = "metrics.jsonl") -> list[dict]:
    path = ROOT / run / name
    return [json.loads(l) for l in path.read_text().splitlines() if l.strip()] if path.is_file() else []


def mean(r: list[dict], key: str) -> float:
    return statistics.mean(x.get(key, 0.0) for x in r)


def boundary(r: list[dict]) -> float:
    return mean(r, "codec/bytes_fwd") + mean(r, "codec/bytes_bwd")


def main():
    cuts = sorted(int(k[len("codec/boundary"):].split("/")[0]) for k in rows("dense")[0] if k.endswith("/bytes_fwd")
                  and k.startswith("codec/boundary"))
    print("| run | " + " | ".join(f"cut {c} fwd / bwd (KB)" for c in cuts) +
          " | boundary (KB) | ref log-probs (KB) | anchor (KB) | wire / dense fp32 |")
    print("|---" * (len(cuts) + 6) + "|")
    for run, label in RUNS.items():
        r, dense = rows(run), rows("dense_s1" if run.endswith("_s1") else "dense")
        if len(r) < 100 or not dense:
            continue
        per_cut = [f"{mean(r, f'codec/boundary{c}/bytes_fwd') / 1e3:.0f} / {mean(r, f'codec/boundary{c}/bytes_bwd') / 1e3:.0f}"
                   for c in cuts]
        total = boundary(r) + mean(r, "codec/bytes_ref_logprobs") + mean(r, "anchor/bytes")
        print(f"| {label} | " + " | ".join(per_cut) + f" | {boundary(r) / 1e3:.0f} | "
              f"{mean(r, 'codec/bytes_ref_logprobs') / 1e3:.1f} | {mean(r, 'anchor/bytes') / 1e3:.0f} | "
              f"{total / boundary(dense):.3f} |")
    print("\n| run | cos(G_comp, G_dense) | gap at step 1 | held-out acc (0, 20, …, 100) | share of dense's gain "
          "| all-equal groups (mean, min–max) |")
    print("|---|---|---|---|---|---|")
    for run, label in RUNS.items():
        r, ev = rows(run), rows(run, "eval.jsonl")
        dense = rows("dense_s1" if run.endswith("_s1") else "dense", "eval.jsonl")
        if len(ev) < 6 or len(dense) < 6:
            continue
        share = (ev[-1]["acc"] - ev[0]["acc"]) / (dense[-1]["acc"] - dense[0]["acc"])
        eq = [x["train/zero_advantage_groups"] for x in r if "train/zero_advantage_groups" in x]
        groups = f"{statistics.mean(eq):.3f} ({min(eq):.2f}–{max(eq):.2f})" if eq else "—"
        cos = statistics.mean(x["grad/cos_comp_dense"] for x in r if "grad/cos_comp_dense" in x)
        print(f"| {label} | {cos:.3f} | {r[0]['rollout_corr/kl']:.3g} | " + " / ".join(f"{e['acc']:.3f}" for e in ev) +
              f" | {share:.2f} | {groups} |")


if __name__ == "__main__":
    main()
