"""notebooks/shares.py on made-up run directories: the share and its interval are what the formula
gives, runs pair by seed, and runs of other starts, commits or endpoint steps are refused."""
import json
import subprocess
import sys

import numpy as np

from conftest import ROOT


def fake_run(d, seed, start, end_rate, digest="a" * 64, commit="c" * 40, n=400, rng=None, last=100):
    d.mkdir(parents=True)
    (d / "config.yaml").write_text(f"model:\n  path: x\ntrain:\n  steps: 100\n  seed: {seed}\n")
    (d / "provenance.json").write_text(json.dumps({"launches": [{"step": 0, "commit": commit,
                                                                 "start": {"weights_sha256": digest}}]}))
    ends = (rng.random(n) < end_rate).astype(int)
    rows = [{"step": 0, "acc": start.mean(), "n": n, "scores": "".join(map(str, start))},
            {"step": last, "acc": ends.mean(), "n": n, "scores": "".join(map(str, ends))}]
    (d / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def shares(*args):
    return subprocess.run([sys.executable, ROOT / "notebooks" / "shares.py", *map(str, args)], capture_output=True,
                          text=True)


def test_the_share_its_interval_and_the_refusals(tmp_path):
    rng = np.random.default_rng(0)
    start = (rng.random(400) < 0.25).astype(int)
    for s in range(4):
        fake_run(tmp_path / f"dense_s{s}", s, start, 0.45, rng=rng)        # gain ≈ +0.20
        fake_run(tmp_path / f"codec_s{s}", s, start, 0.35, rng=rng)        # gain ≈ +0.10: share ≈ 0.5
    out = tmp_path / "t.json"
    p = shares("--dense", tmp_path / "dense_s*", "--recipe", f"codec={tmp_path}/codec_s*", "--boot", 500, "--json", out)
    assert p.returncode == 0, p.stderr
    row = json.loads(out.read_text())["rows"]["codec"]
    dense = np.mean([np.mean([int(c) for c in json.loads((tmp_path / f"dense_s{s}" / "eval.jsonl").read_text()
                                                          .splitlines()[1])["scores"]]) - start.mean() for s in range(4)])
    assert abs(row["dense_gain"] - dense) < 1e-12 and 0.3 < row["share"] < 0.7
    assert row["share_ci"][0] < row["share"] < row["share_ci"][1] and row["share_ci"][1] - row["share_ci"][0] < 0.6
    fake_run(tmp_path / "other_s0", 0, start, 0.35, digest="b" * 64, rng=rng)
    p = shares("--dense", tmp_path / "dense_s*", "--recipe", f"other={tmp_path}/other_s*")
    assert p.returncode != 0 and "different starting weights" in p.stderr
    fake_run(tmp_path / "late_s0", 0, start, 0.35, commit="d" * 40, rng=rng)
    p = shares("--dense", tmp_path / "dense_s0", "--recipe", f"late={tmp_path}/late_s*")
    assert p.returncode != 0 and "different commits" in p.stderr
    p = shares("--dense", tmp_path / "dense_s*", "--recipe", f"few={tmp_path}/codec_s0")
    assert p.returncode != 0 and "do not pair" in p.stderr
    for s, last in ((0, 100), (1, 50)):     # a shorter seed the same glob takes in
        fake_run(tmp_path / "mixed" / f"dense_s{s}", s, start, 0.45, rng=rng, last=last)
        fake_run(tmp_path / "mixed" / f"codec_s{s}", s, start, 0.35, rng=rng, last=last)
    p = shares("--dense", tmp_path / "mixed" / "dense_s*", "--recipe", f"codec={tmp_path}/mixed/codec_s*")
    assert p.returncode != 0 and "evaluations of different steps" in p.stderr and "50" in p.stderr
