"""Each recipe's share of dense's held-out gain, with a 95 % interval, from run directories.

    python notebooks/shares.py --dense 'runs/campaign/dense_s*' --recipe frontier='runs/campaign/frontier_s*' \\
                               [--recipe prf95='...'] [--at 100] [--last 1] [--boot 4000] [--json OUT]

For every run: its held-out evaluations (eval.jsonl, one 0/1 score per prompt in `scores`) and what
it was made from (provenance.json). Runs are paired by seed (`train.seed` in config.yaml): a recipe's
seed s against dense's seed s, which drew the same prompts and samples until the weights differ.

    end_{r,s,i}   prompt i's score at the endpoint: the mean of the `--last` K evaluations up to step
                  `--at` (the run's last evaluation by default)
    gain_r        = mean_s mean_i (end_{r,s,i} − start_{r,s,i}),   start = the step-0 evaluation
    share_r       = gain_r / gain_dense

The interval is the percentile bootstrap of share_r over prompts and seeds together: each of
`--boot` replicates draws n prompts and S seeds with replacement, the same draws for the recipe and
for dense (paired), and recomputes both gains. So it carries both the held-out set's binomial noise
and the seed-to-seed spread of the runs themselves.

It refuses to compare runs whose starting weights differ (provenance's sha256), whose code commits
differ (a campaign shares one commit; `--mixed-commits` to allow), whose held-out sets differ in
size, whose endpoints average evaluations of different steps (a 100-step run matched by the same
glob as 300-step ones), or whose seeds do not pair. The README's table:

    python notebooks/shares.py --dense 'notebooks/campaign/dense_s[01]' \
        --recipe 'frontier=notebooks/campaign/frontier_s[01]' --recipe 'prf95=notebooks/campaign/prf95_s[01]' --last 4
"""
import argparse
import glob
import json
import pathlib
import sys

import numpy as np


def read_jsonl(path: pathlib.Path) -> list[dict]:
    return [json.loads(l) for l in path.read_text().splitlines() if l.strip()] if path.is_file() else []


def seed_of(run: pathlib.Path) -> int:
    """train.seed from the run's config.yaml (0 when the key is not written: the default)."""
    text = (run / "config.yaml").read_text()
    block = text.split("\ntrain:\n", 1)[1] if "\ntrain:\n" in text else ""
    for line in block.splitlines():
        if not line.startswith("  "):
            break
        if line.strip().startswith("seed:"):
            return int(line.split(":", 1)[1])
    return 0


def provenance(run: pathlib.Path) -> tuple[str, str]:
    """(start weights' sha256, commit) of the run's first launch."""
    path = run / "provenance.json"
    if not path.is_file():
        sys.exit(f"{run}: no provenance.json (a run made before starts were recorded): cannot prove its start")
    first = json.loads(path.read_text())["launches"][0]
    return first["start"]["weights_sha256"], first["commit"]


def scores(run: pathlib.Path, at: int | None, last: int) -> tuple[np.ndarray, np.ndarray, tuple[int, ...]]:
    """→ (start scores (n,), endpoint scores (n,), the steps of the evaluations averaged at the endpoint)."""
    evals = [e for e in read_jsonl(run / "eval.jsonl") if "scores" in e]
    if not evals or evals[0]["step"] != 0:
        sys.exit(f"{run}: no step-0 evaluation with per-prompt scores")
    upto = [e for e in evals if at is None or e["step"] <= at]
    if len(upto) < last + 1:
        sys.exit(f"{run}: {len(upto) - 1} evaluations after step 0 up to step {at}, --last {last} asked")
    arr = lambda e: np.array([float(c) for c in e["scores"]]) if isinstance(e["scores"], str) else np.array(e["scores"])
    return arr(evals[0]), np.mean([arr(e) for e in upto[-last:]], axis=0), tuple(e["step"] for e in upto[-last:])


def group(pattern: str, at, last) -> dict[int, dict]:
    runs = sorted(pathlib.Path(p) for p in glob.glob(pattern) if (pathlib.Path(p) / "eval.jsonl").is_file())
    if not runs:
        sys.exit(f"no run directories match {pattern}")
    out = {}
    for run in runs:
        s = seed_of(run)
        if s in out:
            sys.exit(f"{run} and {out[s]['dir']}: the same seed {s} twice in one group")
        start, end, steps = scores(run, at, last)
        out[s] = {"dir": run, "start": start, "end": end, "steps": steps, "prov": provenance(run)}
    return out


def gains(g: dict[int, dict], seeds: list[int], prompts: np.ndarray) -> float:
    return float(np.mean([np.mean(g[s]["end"][prompts] - g[s]["start"][prompts]) for s in seeds]))


def interval(rec: dict, dense: dict, seeds: list[int], boot: int, rng) -> dict:
    n = len(dense[seeds[0]]["start"])
    everything = np.arange(n)
    out = {"gain": gains(rec, seeds, everything), "dense_gain": gains(dense, seeds, everything)}
    out["share"] = out["gain"] / out["dense_gain"] if out["dense_gain"] else float("nan")
    draws = {"gain": [], "dense_gain": [], "share": []}
    for _ in range(boot):
        p, s = rng.integers(0, n, n), [seeds[i] for i in rng.integers(0, len(seeds), len(seeds))]
        g, d = gains(rec, s, p), gains(dense, s, p)
        draws["gain"].append(g)
        draws["dense_gain"].append(d)
        draws["share"].append(g / d if d else float("nan"))
    for k, v in draws.items():
        lo, hi = np.nanpercentile(v, [2.5, 97.5])
        out[k + "_ci"] = [float(lo), float(hi)]
    return out


def check(groups: dict[str, dict], mixed_commits: bool) -> None:
    every = [(name, r) for name, g in groups.items() for r in g.values()]
    starts = {r["prov"][0] for _, r in every}
    if len(starts) > 1:
        sys.exit("runs from different starting weights: " + ", ".join(f"{r['dir']}: {r['prov'][0][:12]}" for _, r in every))
    commits = {r["prov"][1] for _, r in every}
    if len(commits) > 1 and not mixed_commits:
        sys.exit("runs of different commits (a campaign shares one; --mixed-commits to allow): "
                 + ", ".join(f"{r['dir']}: {r['prov'][1][:8]}" for _, r in every))
    sizes = {len(r["start"]) for _, r in every}
    if len(sizes) > 1:
        sys.exit(f"held-out sets of different sizes: {sorted(sizes)}")
    steps = {r["steps"] for _, r in every}
    if len(steps) > 1:   # a 100-step run beside 300-step ones: its "last" evaluations are other steps'
        sys.exit("runs whose endpoints are evaluations of different steps (narrow the globs, or --at): "
                 + ", ".join(f"{r['dir']}: {'/'.join(map(str, r['steps']))}" for _, r in every))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dense", required=True, help="glob of the dense runs")
    p.add_argument("--recipe", action="append", default=[], metavar="NAME=GLOB", help="a compressed recipe's runs")
    p.add_argument("--at", type=int, default=None, help="the endpoint step (default: each run's last evaluation)")
    p.add_argument("--last", type=int, default=1, help="evaluations averaged at the endpoint")
    p.add_argument("--boot", type=int, default=4000)
    p.add_argument("--seed", type=int, default=0, help="the bootstrap's generator")
    p.add_argument("--mixed-commits", action="store_true")
    p.add_argument("--json", default=None, help="write the table as JSON too")
    a = p.parse_args(argv)
    groups = {"dense": group(a.dense, a.at, a.last)}
    for spec in a.recipe:
        name, _, pattern = spec.partition("=")
        groups[name] = group(pattern, a.at, a.last)
    check(groups, a.mixed_commits)
    rng = np.random.default_rng(a.seed)
    dense, rows = groups["dense"], {}
    start, commit = next(iter(dense.values()))["prov"]
    print(f"start {start[:12]}, commit {commit[:8]}, n = {len(next(iter(dense.values()))['start'])} held-out prompts, "
          f"endpoint: mean of the last {a.last} evaluation(s) up to step {a.at or 'the last'}\n")
    print("| recipe | seeds | endpoint step | gain | dense gain | share of dense's gain (95 % interval) | half-width |")
    print("|---|---|---|---|---|---|---|")
    for name, rec in groups.items():
        if name == "dense":
            continue
        seeds = sorted(set(rec) & set(dense))
        if set(rec) != set(dense):
            sys.exit(f"{name}: seeds {sorted(rec)} do not pair with dense's {sorted(dense)}")
        r = rows[name] = interval(rec, dense, seeds, a.boot, rng)
        half = (r["share_ci"][1] - r["share_ci"][0]) / 2
        steps = rec[seeds[0]]["steps"]
        ends = f"{steps[0]}–{steps[-1]}" if len(steps) > 1 else str(steps[0])
        print(f"| {name} | {len(seeds)} | {ends} | {r['gain']:+.4f} [{r['gain_ci'][0]:+.4f}, "
              f"{r['gain_ci'][1]:+.4f}] | {r['dense_gain']:+.4f} [{r['dense_gain_ci'][0]:+.4f}, {r['dense_gain_ci'][1]:+.4f}] "
              f"| {r['share']:.2f} [{r['share_ci'][0]:.2f}, {r['share_ci'][1]:.2f}] | {half:.2f} |")
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps({"start": start, "commit": commit, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
