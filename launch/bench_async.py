"""Step time with generation ahead of training: the same run at rollout.staleness = 0, 1, 2, side by side.

    python launch/bench_async.py [--ds-config ds_configs/prf95.json] [--steps 10] [--staleness 0 1 2]
                                 [--repeats 2] [--rate 100mbit 10mbit] [--out runs/bench_async] [-- key=value ...]

Each configuration is a real `deepspeed --num_gpus 8 launch/train.py` run of --steps steps (the
embedded model unless the overrides say otherwise; `grpo.max_new_tokens` long, so that generation
is a real share of the step), alternated over --repeats rounds so that a machine's drift falls on all
alike. Per run: the mean over steps after the first k + 1 (the sampler fills its queue there) of
`timing/step` (the whole step), `timing/gen` (the wait for the batch: the whole generation at k = 0,
what is left of it at k > 0) and the rest of the step. Prints a markdown table and the ratio of each
k's step time to k = 0's. The runs write to --out/direct-<k>-<round> (overwritten).

`--rate R ...` (root, iproute2): each run goes through launch/multihost.py instead, 8 hosts of one
rank each (network namespaces on this machine), every host's egress capped at R, so that every cut
between stages and every collective crosses a link of that rate; one table per rate, the rates
alternated inside each round with the staleness values; runs under --out/<rate>-<k>-<round>.
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


def run(a, k: int, out: pathlib.Path, rate: str | None = None) -> list[dict]:
    train = ["--ds-config", a.ds_config, "--overwrite", f"train.steps={a.steps}", f"rollout.staleness={k}",
             f"train.eval_every={a.steps}", "train.save_every=0", "log.wandb=false", *a.overrides]
    if rate is None:
        cmd = [DEEPSPEED, "--num_gpus", "8", "--master_port", str(free_port()), "launch/train.py", "--run-dir",
               str(out), *train]
    else:
        cmd = [sys.executable, "launch/multihost.py", "--nodes", "8", "--slots", "1", "--rate", rate, "--run-dir",
               str(out.resolve()), "--master-port", str(free_port()), "--", *train]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if p.returncode:
        sys.exit(f"k={k} {rate or ''} failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
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
    ap.add_argument("--rate", nargs="+", help="through 8 namespaced hosts, each egress capped at each rate")
    ap.add_argument("--out", default="runs/bench_async")
    ap.add_argument("overrides", nargs="*", help="config overrides (after --)")
    a = ap.parse_args(argv)
    rates = a.rate or [None]
    got = {(rate, k): [] for rate in rates for k in a.staleness}
    for r in range(a.repeats):
        for rate in rates:
            for k in a.staleness:
                out = pathlib.Path(a.out) / f"{rate or 'direct'}-{k}-{r}"
                got[rate, k].append(summary(run(a, k, out, rate), k))
                print(f"round {r}, {rate or 'unshaped'}, k={k}: step {got[rate, k][-1][0]:.2f} s, waiting for the "
                      f"batch {got[rate, k][-1][1]:.2f} s", flush=True)
    for rate in rates:
        base = statistics.mean(s for s, _ in got[rate, a.staleness[0]])
        where = f"8 hosts, each egress at {rate}" if rate else "one host, unshaped"
        print(f"\n{a.ds_config} {' '.join(a.overrides)}, {where}, {a.steps} steps, {a.repeats} rounds\n")
        print("| rollout.staleness | step (s) | waiting for the batch (s) | rest of the step (s) | step / k=0's |")
        print("|---|---|---|---|---|")
        for k in a.staleness:
            xs = got[rate, k]
            step, gen = statistics.mean(s for s, _ in xs), statistics.mean(g for _, g in xs)
            print(f"| {k} | {step:.2f} | {gen:.2f} | {step - gen:.2f} | {step / base:.2f} |")


if __name__ == "__main__":
    main()
