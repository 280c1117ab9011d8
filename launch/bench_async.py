"""Step time with generation ahead of training: the same run at rollout.staleness = 0, 1, 2, side by side.

    python launch/bench_async.py [--ds-config ds_configs/prf95.json] [--steps 10] [--staleness 0 1 2]
                                 [--repeats 2] [--out runs/bench_async] [-- key=value ...]

Each configuration is a real `deepspeed --num_gpus 8 launch/train.py` run of --steps steps (the
embedded model unless the overrides say otherwise; `grpo.max_new_tokens` long, so that generation
is a real share of the step), alternated over --repeats rounds so that a machine's drift falls on all
alike. Per run: the mean over steps after the first k + 1 (the sampler fills its queue there) of
`timing/step` (the whole step), `timing/gen` (the wait for the batch: the whole generation at k = 0,
what is left of it at k > 0) and the rest of the step. Prints a markdown table and the ratio of each
k's step time to k = 0's. The runs write to --out/<k>-<round> (overwritten).
"""
import argparse
import json
import os
import pathlib
import shutil
import socket
import statistics
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEEPSPEED = shutil.which("deepspeed", path=os.path.dirname(sys.executable)) or "deepspeed"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(a, k: int, out: pathlib.Path) -> list[dict]:
    cmd = [DEEPSPEED, "--num_gpus", "8", "--master_port", str(free_port()), "launch/train.py", "--ds-config",
           a.ds_config, "--run-dir", str(out), "--overwrite", f"train.steps={a.steps}", f"rollout.staleness={k}",
           f"train.eval_every={a.steps}", "train.save_every=0", "log.wandb=false", *a.overrides]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if p.returncode:
        sys.exit(f"k={k} failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines() if l.strip()]


def summary(rows: list[dict], k: int) -> tuple[float, float]:
    """(mean step seconds, mean seconds waiting for the batch) over the steps after the first k + 1."""
    kept = rows[k + 1:]
    return statistics.mean(r["timing/step"] for r in kept), statistics.mean(r["timing/gen"] for r in kept)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ds-config", default="ds_configs/prf95.json")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default="runs/bench_async")
    ap.add_argument("overrides", nargs="*", help="config overrides (after --)")
    a = ap.parse_args(argv)
    got = {k: [] for k in a.staleness}
    for r in range(a.repeats):
        for k in a.staleness:
            got[k].append(summary(run(a, k, pathlib.Path(a.out) / f"{k}-{r}"), k))
            print(f"round {r}, k={k}: step {got[k][-1][0]:.2f} s, waiting for the batch {got[k][-1][1]:.2f} s", flush=True)
    base = statistics.mean(s for s, _ in got[a.staleness[0]])
    print(f"\n{a.ds_config} {' '.join(a.overrides)}, {a.steps} steps, {a.repeats} rounds\n")
    print("| rollout.staleness | step (s) | waiting for the batch (s) | rest of the step (s) | step / k=0's |")
    print("|---|---|---|---|---|")
    for k, xs in got.items():
        step, gen = statistics.mean(s for s, _ in xs), statistics.mean(g for _, g in xs)
        print(f"| {k} | {step:.2f} | {gen:.2f} | {step - gen:.2f} | {step / base:.2f} |")


if __name__ == "__main__":
    main()
