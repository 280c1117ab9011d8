"""The identical-numbers check: the same seeded runs at two commits, diffed bit for bit.

    python notebooks/same_numbers.py BEFORE AFTER [--steps 20] [--probe-every 5] [--out runs/same_numbers]
                                     [--recipes dense prf95 lowrank lowrank_drift rotated frontier_wide prf95_ahead
                                                 frontier_wide_ahead]
                                     [--may-differ KEY ...] [--renamed OLD=NEW ...] [--wide-start DIR]
                                     [--after-overrides KEY=VALUE ...]

A change that should not change numbers proves it: each commit is checked out into its own git
worktree and runs each recipe there (`deepspeed --num_gpus 8 launch/train.py`, its own package on
the path, the anchor process included), then every `metrics.jsonl` row, every `eval.jsonl` row and
every exported weight are compared exactly. Machine readings (`timing/*`, `anchor/wait`, `memory/*`) are left out
of the comparison; nothing else is. A commit's runs are kept under OUT/<sha>/<recipe> and reused
when complete, so comparing a new commit against an old one reruns only the new one. Exit status
1 when anything differs. Runs share one model cache (`$DS_TWOCIRCUIT_CACHE`), one at a time.

`--may-differ KEY ...`: metrics keys a change is meant to move (a file format's byte counts, say;
KEY ending in "/" names every key under it, a new family of metrics included); their differences are
still printed and counted, in their own column, and do not fail the check. `--after-overrides
KEY=VALUE ...`: config overrides for AFTER's runs only (a switch the change added, set to what the
old code did); those runs are kept apart, under OUT/<sha>+<overrides>.
Eval rows (the keys both sides wrote) and weights may never differ. `--renamed OLD=NEW ...`: metrics the change renamed, all at
once (two may swap names); BEFORE's rows are read under the new names, so the values still compare
bit for bit. `frontier_wide` (and `frontier_wide_ahead`, the same a step ahead with the rollout
correction) runs the wide recipe from a fixed HF start (`--wide-start DIR`) at 8
prompts a step and 256 held-out rows: the same check at a tenth of the recipe's cost.
"""
import argparse
import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
# recipe → its ds_configs/ file and the overrides that make it the check's run
RECIPES = {"dense": ("dense", []), "prf95": ("prf95", []), "lowrank": ("lowrank", []),
           "lowrank_drift": ("lowrank_drift", ["control.enabled=true"]),
           "rotated": ("prf95", ["codec.name=rotated", "codec.fwd_bits=4", "codec.bwd_coords=40", "codec.bwd_bits=2"]),
           "frontier_wide": ("frontier_wide", ["grpo.prompts_per_step=8", "data.eval_size=256"]),
           "prf95_ahead": ("prf95", ["rollout.staleness=1", "grpo.rollout_correction.enabled=true"]),
           "frontier_wide_ahead": ("frontier_wide", ["grpo.prompts_per_step=8", "data.eval_size=256",
                                                     "rollout.staleness=1", "grpo.rollout_correction.enabled=true"])}
WALL_CLOCK = ("timing/", "anchor/wait", "memory/")
# the launcher of the interpreter running this script, found without an activated venv
DEEPSPEED = shutil.which("deepspeed", path=os.path.dirname(sys.executable)) or shutil.which("deepspeed") or "deepspeed"


def sha_of(rev: str) -> str:
    return subprocess.run(["git", "rev-parse", rev], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def complete(run_dir: pathlib.Path, steps: int) -> bool:
    m = run_dir / "metrics.jsonl"
    return m.is_file() and len(read_jsonl(m)) == steps and any((run_dir / "model").glob("*.safetensors"))


def run_name(sha: str, overrides: list[str]) -> str:
    """A commit's runs' directory under OUT: the sha, and the overrides they ran with."""
    return "+".join([sha, *(o.replace("/", "_") for o in overrides)])


def run_commit(sha: str, recipes: list[str], a, overrides: list[str] = ()) -> None:
    """Each recipe at `sha` (with `overrides`), in a temporary worktree of it, unless its run is
    already complete."""
    name = run_name(sha, list(overrides))
    todo = [r for r in recipes if not complete(pathlib.Path(a.out) / name / r, a.steps)]
    if not todo:
        return
    tree = pathlib.Path(tempfile.mkdtemp(prefix=f"same-{sha[:8]}-"))
    subprocess.run(["git", "worktree", "add", "--detach", str(tree), sha], cwd=ROOT, check=True, capture_output=True)
    try:
        for recipe in todo:
            run_dir = (pathlib.Path(a.out) / name / recipe).resolve()
            shutil.rmtree(run_dir, ignore_errors=True)
            run_dir.mkdir(parents=True)
            cmd = [DEEPSPEED, "--num_gpus", "8", "--master_port", str(free_port()),
                   "launch/train.py", "--ds-config", f"ds_configs/{RECIPES[recipe][0]}.json", "--run-dir", str(run_dir),
                   f"train.steps={a.steps}", f"train.probe_every={a.probe_every}", f"train.eval_every={a.steps}",
                   "log.wandb=false", *RECIPES[recipe][1], *overrides]
            if RECIPES[recipe][0] == "frontier_wide":
                if not a.wide_start:
                    sys.exit(f"{recipe} needs --wide-start DIR (an HF export of the wide model to start from)")
                cmd.append(f"model.path={pathlib.Path(a.wide_start).resolve()}")
            print(f"[{sha[:8]}] {recipe}: {' '.join(cmd[5:])}", flush=True)
            # cwd and PYTHONPATH: the worktree's package, for the trainer and the anchor it starts
            with open(run_dir / "launch.log", "w") as log:
                p = subprocess.run(cmd, cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)}, stdout=log,
                                   stderr=subprocess.STDOUT)
            if p.returncode != 0:
                sys.exit(f"[{sha[:8]}] {recipe} failed (rc {p.returncode}): see {run_dir / 'launch.log'}")
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, capture_output=True)


def read_jsonl(path: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def weights(run_dir: pathlib.Path) -> dict:
    from safetensors.torch import load_file
    out = {}
    for f in sorted((run_dir / "model").glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def ulps(a: float, b: float) -> int:
    """How many float64 values lie between a and b (0: bitwise equal)."""
    import struct
    key = lambda x: (lambda i: i if i >= 0 else -(i & 0x7FFFFFFFFFFFFFFF))(struct.unpack("<q", struct.pack("<d", x))[0])
    return abs(key(a) - key(b))


def compare_rows(a: list[dict], b: list[dict], renamed: dict[str, str] = {}) -> tuple[int, list[tuple[str, str]]]:
    """→ (keys compared, the differences as (key, one line: step, key, both values, their distance in
    ulps)); `a`'s keys are read under their `renamed` names first."""
    diffs, n = [], 0
    a = [{renamed.get(k, k): v for k, v in r.items()} for r in a]
    if [r["step"] for r in a] != [r["step"] for r in b]:
        return 0, [("step", f"steps differ: {[r['step'] for r in a]} vs {[r['step'] for r in b]}")]
    for ra, rb in zip(a, b):
        keep = lambda r: {k: v for k, v in r.items() if not k.startswith(WALL_CLOCK)}
        ka, kb = keep(ra), keep(rb)
        for k in sorted(ka.keys() ^ kb.keys()):
            diffs.append((k, f"step {ra['step']}: key {k} only in {'before' if k in ka else 'after'}"))
        for k in sorted(ka.keys() & kb.keys()):
            n += 1
            if ka[k] != kb[k] and not (ka[k] != ka[k] and kb[k] != kb[k]):   # NaN equals NaN here
                far = f" ({ulps(ka[k], kb[k])} ulp)" if isinstance(ka[k], float) and isinstance(kb[k], float) else ""
                diffs.append((k, f"step {ra['step']}: {k} {ka[k]!r} vs {kb[k]!r}{far}"))
    return n, diffs


def meant(key: str, may_differ: tuple[str, ...]) -> bool:
    return any(key == m or (m.endswith("/") and key.startswith(m)) for m in may_differ)


def compare(before: str, after: str, recipes: list[str], out: pathlib.Path, may_differ: tuple[str, ...] = (),
            renamed: dict[str, str] = {}) -> bool:
    import torch
    same = True
    print("\n| recipe | metrics rows | values compared | differing | of them allowed | eval rows equal | tensors "
          "| weights bitwise equal |")
    print("|---|---|---|---|---|---|---|---|")
    for recipe in recipes:
        da, db = out / before / recipe, out / after / recipe
        n, diffs = compare_rows(read_jsonl(da / "metrics.jsonl"), read_jsonl(db / "metrics.jsonl"), renamed)
        ea, eb = read_jsonl(da / "eval.jsonl"), read_jsonl(db / "eval.jsonl")   # a key one side added is not a number moved
        evals = len(ea) == len(eb) > 0 and all(ra[k] == rb[k] for ra, rb in zip(ea, eb) for k in ra.keys() & rb.keys())
        wa, wb = weights(da), weights(db)
        w_equal = bool(wa) and wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)   # none exported is no proof
        allowed = [line for k, line in diffs if meant(k, may_differ)]
        ok = len(allowed) == len(diffs) and evals and w_equal
        same &= ok
        print(f"| {recipe} | {len(read_jsonl(da / 'metrics.jsonl'))} | {n} | {len(diffs)} | {len(allowed)} | {evals} "
              f"| {len(wa)} | {w_equal} |")
        for k, line in diffs[:20]:
            print(f"    {recipe}: {line}{' (allowed)' if meant(k, may_differ) else ''}")
    return same


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("before")
    p.add_argument("after")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--probe-every", type=int, default=5)
    p.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    p.add_argument("--out", default=str(ROOT / "runs" / "same_numbers"))
    p.add_argument("--may-differ", nargs="+", default=[], metavar="KEY",
                   help="metrics keys the change is meant to move (counted and printed, not failing)")
    p.add_argument("--renamed", nargs="+", default=[], metavar="OLD=NEW", help="metrics keys the change renamed")
    p.add_argument("--wide-start", default=None, help="frontier_wide's starting model (an HF directory)")
    p.add_argument("--after-overrides", nargs="+", default=[], metavar="KEY=VALUE",
                   help="config overrides for AFTER's runs only (a new switch set to the old behaviour)")
    a = p.parse_args(argv)
    renamed = dict(pair.split("=", 1) for pair in a.renamed)
    before, after = sha_of(a.before), sha_of(a.after)
    run_commit(before, a.recipes, a)
    run_commit(after, a.recipes, a, a.after_overrides)
    ok = compare(before, run_name(after, a.after_overrides), a.recipes, pathlib.Path(a.out), tuple(a.may_differ), renamed)
    verdict = "DIFFERENT" if not ok else f"bitwise equal but {', '.join(a.may_differ)}" if a.may_differ else "bitwise equal"
    with_ = f" ({' '.join(a.after_overrides)})" if a.after_overrides else ""
    print(f"\n{before[:8]} vs {after[:8]}{with_}, {a.steps} steps, probe every {a.probe_every}: {verdict}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
