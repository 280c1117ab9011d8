"""The README's leading tables from the runs notebooks/readme_runs.sh made (runs/readme/<name>/).

    python notebooks/readme_tables.py [runs/readme]
"""
import json
import pathlib
import statistics
import sys

ROOT = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "runs/readme")


def rows(run: str, name: str = "metrics.jsonl") -> list[dict]:
    path = ROOT / run / name
    return [json.loads(l) for l in path.read_text().splitlines() if l.strip()] if path.is_file() else []


def mean(run: str, key: str, first: int = 2) -> float:
    vals = [r[key] for r in rows(run) if r["step"] >= first and key in r]
    return statistics.mean(vals) if vals else float("nan")


def main():
    runs = sorted(p.name for p in ROOT.iterdir() if (p / "eval.jsonl").is_file())
    print("| run | held-out acc (steps 0, 20, …, 100) | reward 1–10 / 91–100 | s/step |\n|---|---|---|---|")
    for run in runs:
        acc = " / ".join(f"{r['acc']:.3f}" for r in rows(run, "eval.jsonl"))
        rew = [r["critic/score/mean"] for r in rows(run)]
        print(f"| {run} | {acc} | {statistics.mean(rew[:10]):.3f} / {statistics.mean(rew[-10:]):.3f} | "
              f"{mean(run, 'timing/step'):.2f} |")
    print("\n| mean reward over steps | " + " | ".join(f"{i + 1}–{i + 10}" for i in range(0, 100, 10)) +
          " |\n" + "|---" * 11 + "|")
    for run in runs:
        rew = [r["critic/score/mean"] for r in rows(run)]
        print(f"| {run} | " + " | ".join(f"{statistics.mean(rew[i:i + 10]):.3f}" for i in range(0, len(rew), 10)) + " |")
    print("\n| seconds per step (mean of steps 2–100) | generation | anchor | train | sync | of it sampler load | total |"
          "\n|---|---|---|---|---|---|---|")
    for run in runs:
        print(f"| {run} | " + " | ".join(f"{mean(run, k):.2f}" for k in
                                          ("timing/gen", "timing/anchor", "timing/train", "timing/sync")) +
              f" | {mean(run, 'timing/sampler_load'):.3f} | {mean(run, 'timing/step'):.2f} |")
    print("\n| run | rollout_corr/kl | prob_diff_mean | logp_diff_mean | probe/rollout_corr/kl | probe prob_diff_mean "
          "| probe logp_diff_mean |\n|---|---|---|---|---|---|---|")
    for run in runs:
        keys = ["rollout_corr/kl", "rollout_corr/prob_diff_mean", "rollout_corr/logp_diff_mean"]
        vals = [mean(run, k, 1) for k in keys] + [mean(run, "probe/" + k, 1) for k in keys]
        print(f"| {run} | " + " | ".join(f"{v:.3g}" for v in vals) + " |")
    print("\n| run | cos(G_comp, G_dense) | cos(G_corr, G_dense) | sign agreement | fwd ratio step 1 / later | bwd ratio |"
          "\n|---|---|---|---|---|---|")
    for run in runs:
        r = rows(run)
        dense = {"fwd": "codec/dense_equiv_bytes", "bwd": "codec/dense_equiv_bytes_bwd"}
        ratio = lambda x, d: x[f"codec/bytes_{d}"] / x[dense[d]] if x.get(dense[d]) else float("nan")
        later = statistics.mean(ratio(x, "fwd") for x in r[1:]) if len(r) > 1 else float("nan")
        print(f"| {run} | {mean(run, 'grad/cos_comp_dense', 1):.3f} | {mean(run, 'grad/cos_corrected_dense', 1):.3f} | "
              f"{mean(run, 'anchor/sign_agreement', 1):.3f} | {ratio(r[0], 'fwd'):.4f} / {later:.4f} | "
              f"{statistics.mean(ratio(x, 'bwd') for x in r):.4f} |")


if __name__ == "__main__":
    main()
