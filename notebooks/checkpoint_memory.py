"""Peak memory per stage with and without activation checkpointing, side by side in one invocation.

Two short runs of one recipe through DeepSpeed's launcher, the second with a copy of its JSON that
adds `pipeline.activation_checkpoint_interval` (decoder layers per recomputed segment); each run
logs `memory/peak_rss_mib/stage{s}` (the stage process's peak resident memory) and its step time.
Prints one markdown table: stage, peak RSS without, with, and the difference.

    python notebooks/checkpoint_memory.py [--recipe ds_configs/dense.json] [--interval 1]
        [--out runs/checkpoint_memory] [override ...]   (e.g. model.embedded=wide train.steps=2)
"""
import argparse
import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run(recipe: pathlib.Path, run_dir: pathlib.Path, overrides: list[str], port: int) -> list[dict]:
    cmd = ["deepspeed", "--num_gpus", "8", "--master_port", str(port), "launch/train.py", "--ds-config", str(recipe),
           "--run-dir", str(run_dir), *overrides]
    with open(run_dir.parent / f"{run_dir.name}.log", "w") as log:
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=log, stderr=subprocess.STDOUT)
    return [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l.strip()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="ds_configs/dense.json")
    ap.add_argument("--interval", type=int, default=1)
    ap.add_argument("--out", default="runs/checkpoint_memory")
    ap.add_argument("--port", type=int, default=29611)
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    out = ROOT / a.out
    out.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((ROOT / a.recipe).read_text())
    cfg["pipeline"] = {**cfg.get("pipeline", {}), "activation_checkpoint_interval": a.interval}
    ckpt = out / f"{pathlib.Path(a.recipe).stem}_ckpt{a.interval}.json"
    ckpt.write_text(json.dumps(cfg, indent=1))
    results = {}
    for name, recipe in (("without", ROOT / a.recipe), ("with", ckpt)):
        results[name] = run(recipe, out / name, a.overrides, a.port)
    last = {k: r[-1] for k, r in results.items()}
    stages = sorted(int(k.rsplit("stage", 1)[1]) for k in last["without"] if k.startswith("memory/peak_rss_mib/"))
    print(f"recipe {a.recipe} {' '.join(a.overrides)}, interval {a.interval}, {len(results['with'])} steps")
    print("| stage | peak RSS without (MiB) | with (MiB) | with − without |")
    print("|---|---|---|---|")
    for s in stages:
        w0, w1 = (last[k][f"memory/peak_rss_mib/stage{s}"] for k in ("without", "with"))
        print(f"| {s} | {w0:.0f} | {w1:.0f} | {w1 - w0:+.0f} |")
    t = {k: sum(r["timing/train"] for r in rs) / len(rs) for k, rs in results.items()}
    print(f"train time per step: without {t['without']:.2f} s, with {t['with']:.2f} s")


if __name__ == "__main__":
    sys.exit(main())
