"""The slow-link benchmark in miniature: two stages in two network namespaces, shaped and unshaped."""
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, can_make_namespaces


@pytest.mark.dist
def test_two_namespaces_two_stages(cache_dir, tmp_path):
    why = can_make_namespaces()
    if why:
        pytest.skip(why)
    p = subprocess.run([sys.executable, "launch/bench_links.py", "--stages", "2", "--hidden", "64", "--intermediate",
                        "64", "--rates", "unshaped", "10mbit", "--steps", "1", "--phase-timeout", "120",
                        "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "tcl" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "tcl" not in subprocess.run(["ip", "link", "show"], capture_output=True, text=True).stdout
    res = {(r["launch"], r["phase"]["codec"], r["phase"]["rate"]): r
           for r in json.loads((tmp_path / "results.json").read_text())}
    fwd = lambda r: r["per_stage"][0][0]                          # stage 0 → 1 bytes per step (p2p)
    bwd = lambda r: r["per_stage"][1][1]                          # stage 1 → 0
    assert fwd(res[("prf", "prf", "10mbit")]) < 0.2 * fwd(res[("prf", "dense", "10mbit")])
    # rotated, forward 64 × 4 bits (34 of 256 B per token), back 40 × 2 bits (12 B), in its own launch
    dense = res[("rotated", "dense", "10mbit")]
    assert 34 / 256 < fwd(res[("rotated", "rotated", "10mbit")]) / fwd(dense) < 34 / 256 * 1.1
    assert bwd(res[("rotated", "rotated", "10mbit")]) == bwd(dense) * 12 / 256
    for r in res.values():                                        # the wire carries at least what p2p handed it
        assert r["iface_bytes_per_step"][0] >= fwd(r)
    assert "| 10mbit |" in (tmp_path / "table.md").read_text() and "rotated s/step" in (tmp_path / "table.md").read_text()
