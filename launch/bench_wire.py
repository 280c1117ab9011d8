"""Every byte between hosts, per recipe: short runs side by side from one start, and the table of
their `wire/*` counters (pipeline/traffic.py) against a dense bf16 pipeline's.

    python launch/bench_wire.py --start DIR [--steps 10] [--out runs/bench_wire]
                                [--runs dense frontier_wide prf95 prf95_external ...] [--table-only]

Each run is `deepspeed --num_gpus 8 launch/train.py --ds-config ds_configs/<recipe>.json
model.path=START` for `--steps` steps (one held-out evaluation of 256 rows at step 0, none after; the
recipe's probe cadence), on one machine, so the placement is a host per stage (the managed anchor on
rank 0's host). `<recipe>_external` runs the recipe with `anchor.external=true` and the anchor started
here as a user would on a host of its own (launch/anchor.py on the run's mailbox): its files cross.
`<recipe>_fp32` runs it with `sampler.dtype=float32` (the stream as fp32 deltas). A run directory
that holds its steps already is read, not run again.

The table: MB a step (mean over the run's steps) per kind, the total and the dense bf16 baseline
(`wire/baseline_bytes`: bf16 boundaries at their dense size, the same stream, rollout and tied
gradients); total / baseline; the boundaries alone against their dense bf16 size; the busiest
directed host pair; the stream's changed share.
"""
import argparse
import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run(name: str, start: str, steps: int, out: pathlib.Path, port: int) -> pathlib.Path:
    recipe = name.removesuffix("_external").removesuffix("_fp32")
    run_dir = out / name
    rows = run_dir / "metrics.jsonl"
    if rows.is_file() and len(rows.read_text().splitlines()) >= steps:
        return run_dir
    extra = (["anchor.external=true"] if name.endswith("_external") else []) + \
        (["sampler.dtype=float32"] if name.endswith("_fp32") else [])
    cmd = ["deepspeed", "--num_gpus", "8", "--master_port", str(port), "launch/train.py", "--ds-config",
           f"ds_configs/{recipe}.json", "--run-dir", str(run_dir), "--overwrite", f"model.path={start}",
           f"train.steps={steps}", "train.eval_every=1000", "train.save_every=0", "data.eval_size=256",
           "log.wandb=false", *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    anchor = None
    if name.endswith("_external"):
        anchor = subprocess.Popen([sys.executable, str(ROOT / "launch" / "anchor.py"), "--mailbox",
                                   str(run_dir / "anchor")], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        print(f"[bench_wire] {name}: {' '.join(cmd[4:])}", flush=True)
        subprocess.run(cmd, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
        if anchor is not None:
            anchor.wait(timeout=120)          # the trainer's STOP ends it
    finally:
        if anchor is not None and anchor.poll() is None:
            anchor.kill()
    return run_dir


def table(dirs: list[pathlib.Path]) -> None:
    mb = lambda x: f"{x / 1e6:.2f}"
    print("MB a step (mean over the run's steps); boundaries = update, reference and dense passes\n")
    print("| run | boundaries | probe | stream | rollout | tied | signs | anchor files | total | baseline | "
          "total / baseline | boundaries / their dense bf16 | busiest link | stream changed |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for d in dirs:
        rows = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
        mean = lambda k: sum(r[k] for r in rows) / len(rows)
        boundary = sum(mean(f"wire/{k}_bytes") for k in ("boundary_update", "boundary_reference", "boundary_dense"))
        files = mean("wire/anchor_theta_bytes") + mean("wire/anchor_signs_bytes")
        print(f"| {d.name} | {mb(boundary)} | {mb(mean('wire/boundary_probe_bytes'))} | {mb(mean('wire/stream_bytes'))} | "
              f"{mb(mean('wire/rollout_bytes') + mean('wire/reference_bytes'))} | {mb(mean('wire/tied_grads_bytes'))} | "
              f"{mb(mean('wire/signs_bytes'))} | {mb(files)} | {mb(mean('wire/total_bytes'))} | "
              f"{mb(mean('wire/baseline_bytes'))} | {mean('wire/total_bytes') / mean('wire/baseline_bytes'):.3f} | "
              f"{boundary / mean('wire/baseline_boundary_bytes'):.3f} | {mb(mean('wire/busiest_link_bytes'))} | "
              f"{mean('sync/changed_frac'):.3f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--start", required=True, help="an HF model directory every run starts from")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", default="runs/bench_wire")
    ap.add_argument("--runs", nargs="+", default=["dense", "dense_fp32", "frontier_wide", "frontier_wide_fp32",
                                                  "prf95", "prf95_external"])
    ap.add_argument("--port", type=int, default=29650)
    ap.add_argument("--table-only", action="store_true", help="read the run directories, run nothing")
    a = ap.parse_args()
    out = pathlib.Path(a.out).resolve()
    start = str(pathlib.Path(a.start).resolve())
    dirs = [out / n if a.table_only else run(n, start, a.steps, out, a.port) for n in a.runs]
    table(dirs)


if __name__ == "__main__":
    main()
