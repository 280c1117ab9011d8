"""The rollout correction's readings per run: the sampler–trainer gap split by source on probe steps,
and with the correction on, its weights.

    python notebooks/correction_table.py RUN_DIR [RUN_DIR ...] [--steps 100]

Each run's metrics.jsonl (or the campaign's kept metrics.jsonl.gz) up to --steps; one markdown row
per run: the mean over probe steps (dense steps left out: the codec is off there) of
mismatch/numerics_kl, mismatch/codec_kl and their *_logp_diff, and rollout_corr/kl over the same
steps (numerics + codec add up to it with one PPO mini-batch: the split is the first mini-batch's),
and with the sampler ahead mismatch/staleness_kl and _logp_diff ("—" where the run did not split
it: numerics then holds the staleness); with the correction on, the mean over all steps of rollout_is_mean,
rollout_is_eff_sample_size, rollout_is_ratio_fraction_high and rollout_rs_masked_fraction, and the
largest rollout_is_max.
"""
import argparse
import gzip
import json
import pathlib

SPLIT = ("mismatch/staleness_kl", "mismatch/numerics_kl", "mismatch/codec_kl", "mismatch/staleness_logp_diff",
         "mismatch/numerics_logp_diff", "mismatch/codec_logp_diff")
WEIGHTS = ("rollout_corr/rollout_is_mean", "rollout_corr/rollout_is_eff_sample_size",
           "rollout_corr/rollout_is_ratio_fraction_high", "rollout_corr/rollout_rs_masked_fraction")


def rows_of(run: pathlib.Path, steps: int) -> list[dict]:
    path = run / "metrics.jsonl"
    text = path.read_text() if path.is_file() else gzip.open(run / "metrics.jsonl.gz", "rt").read()
    return [r for r in map(json.loads, filter(str.strip, text.splitlines())) if r["step"] <= steps]


def mean(rows: list[dict], key: str) -> float:
    vals = [r[key] for r in rows if key in r]
    return sum(vals) / len(vals) if vals else float("nan")


def row(run: pathlib.Path, steps: int) -> str:
    rows = rows_of(run, steps)
    probed = [r for r in rows if "mismatch/codec_kl" in r and not r.get("train/dense_step")]   # codec on
    split = " | ".join(f"{mean(probed, k):.3g}" if any(k in r for r in probed) else "—"
                       for k in (*SPLIT, "rollout_corr/kl"))
    if "rollout_corr/rollout_is_mean" in rows[0]:
        weights = " | ".join(f"{mean(rows, k):.3g}" for k in WEIGHTS)
        weights += f" | {max(r['rollout_corr/rollout_is_max'] for r in rows):.3g}"
    else:
        weights = " | ".join(["—"] * (len(WEIGHTS) + 1))
    return f"| {run.name} | {len(probed)} | {split} | {weights} |"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=pathlib.Path)
    ap.add_argument("--steps", type=int, default=100)
    a = ap.parse_args(argv)
    print("| run | probe steps | staleness kl | numerics kl | codec kl | staleness \\|Δ\\| | numerics \\|Δ\\| | "
          "codec \\|Δ\\| | rollout_corr/kl | IS mean | ESS | > C | rejected | max |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for run in a.runs:
        print(row(run, a.steps))


if __name__ == "__main__":
    main()
