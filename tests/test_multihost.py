"""Multi-host: launch/train.py through DeepSpeed's multi-node launcher across hosts made as network
namespaces (launch/multihost.py), against the same run on one host."""
import os
import subprocess
import sys

import pytest
import torch
from conftest import ANCHORED, ROOT, VOLATILE, can_make_namespaces, rows, weights

from ds_twocircuit.pipeline.traffic import KINDS

pytestmark = pytest.mark.dist

def namespaces() -> set[str]:
    """The machine's namespace names. Compared before and after a run, so that one left by an earlier
    process killed with SIGKILL (which no cleanup outlives) does not fail this run's check."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def multihost(run_dir, *overrides, timeout=400):
    why = can_make_namespaces()
    if why:
        pytest.skip(why)
    before = namespaces()
    p = subprocess.run([sys.executable, "launch/multihost.py", "--nodes", "2", "--slots", "4", "--anchor-host",
                        "--run-dir", str(run_dir), "--master-port", str(29000 + os.getpid() % 500), "--",
                        "--ds-config", "tests/configs/tiny.json", *overrides], cwd=ROOT, capture_output=True,
                       text=True, timeout=timeout, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert namespaces() <= before, namespaces() - before          # every namespace it made is gone
    return p


def test_two_hosts_and_an_anchor_host_equal_one_host(anchored, tmp_path):
    """8 stages over 2 hosts × 4 ranks (stages 0–3 | 4–7: cut 3 crosses the bridge), the anchor on a
    third host (anchor.external) serving the shared mailbox, ANCHORED's config: the same rows,
    bit for bit but wall-clock, and the same weights as 8 ranks and the managed anchor on one host.
    Each rank seals the files it wrote of every checkpoint."""
    p = multihost(tmp_path / "two", *ANCHORED)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "global_rank_mapping=defaultdict(<class 'list'>, {'host0': [0, 1, 2, 3], 'host1': [4, 5, 6, 7]})" in p.stdout + p.stderr
    stable = lambda r: {k: v for k, v in r.items() if not k.startswith((*VOLATILE, "wire/"))}
    one, two = rows(anchored), rows(tmp_path / "two")
    assert [stable(r) for r in one] == [stable(r) for r in two]
    for a, b in zip(one, two):
        assert_wire_follows_the_hosts(a, b)
    assert rows(anchored, "eval.jsonl") == rows(tmp_path / "two", "eval.jsonl")
    wa, wb = weights(anchored), weights(tmp_path / "two")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[n], wb[n]) for n in wa)
    ckpt = tmp_path / "two" / "checkpoints" / "step12"
    assert (ckpt / "manifest.rank0.json").is_file() and (ckpt / "manifest.rank7.json").is_file()
    assert "fire 2: replayed" in p.stdout and "STOP found" in p.stdout   # the anchor host's log


def assert_wire_follows_the_hosts(a: dict, b: dict) -> None:
    """The traffic ledger's wire counters (pipeline/traffic.py) follow the placement the launcher
    made: one host (a host per stage, the managed anchor on rank 0's) against two hosts and the
    anchor's own. Only cut 3 crosses between the two hosts; only stages 4-7's deltas and signs, the
    tied gradients of stages 0 and 7, and the rollout's share for ranks 4-7 cross; every file the
    anchor reads or writes crosses to its host. Each counter is the receiving transport's count; the
    keys it is checked against are the senders' (codec/*, anchor/*) or rank 0's own (sync/bytes)."""
    boundary = lambda r: sum(r[f"wire/boundary_{k}_bytes"] for k in ("update", "reference", "dense"))
    assert boundary(a) == a["codec/bytes_fwd"] + a["codec/bytes_bwd"] > 0
    assert boundary(b) == b["codec/boundary3/bytes_fwd"] + b["codec/boundary3/bytes_bwd"] > 0
    assert a["wire/stream_bytes"] == a["sync/bytes"] > b["wire/stream_bytes"] > 0
    assert a["wire/anchor_theta_bytes"] == a["wire/anchor_signs_bytes"] == 0
    assert b["wire/anchor_theta_bytes"] == b["anchor/bytes_up"] and b["wire/anchor_signs_bytes"] == b["anchor/bytes_down"]
    assert 0 < b["wire/tied_grads_bytes"] == a["wire/tied_grads_bytes"]
    assert 0 < b["wire/rollout_bytes"] < a["wire/rollout_bytes"]
    assert (a["wire/signs_bytes"] > 0) == (b["wire/signs_bytes"] > 0)
    for r in (a, b):
        assert r["wire/total_bytes"] == sum(r[f"wire/{k}_bytes"] for k in KINDS) >= r["wire/busiest_link_bytes"] > 0


def test_a_failing_host_ends_the_run_and_cleans_up(tiny_model, tmp_path):
    """A config error on every host: each prints one line, the harness exits non-zero and removes
    what it made (namespaces, links, processes) well before any timeout."""
    p = multihost(tmp_path / "bad", "train.stpes=3", timeout=120)
    assert p.returncode != 0
    assert "train.stpes" in p.stdout + p.stderr
