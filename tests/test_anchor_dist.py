"""The anchor circuit on real launches: 8 DeepSpeed CPU ranks plus the separate anchor process."""
import json
import math
import os
import pathlib
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch
from conftest import ROOT, TINY, launch, launch_cmd, rows, stages
from safetensors.torch import load_file

from ds_twocircuit.anchor.mailbox import HEADER_BYTES, published_fires, sign_dir

pytestmark = pytest.mark.dist


def exported(run_dir) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted((pathlib.Path(run_dir) / "model").glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def complete_rows(run_dir) -> list[dict]:
    path = pathlib.Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in open(path) if line.endswith("}\n")] if path.is_file() else []


def logged_steps(run_dir) -> int:
    path = pathlib.Path(run_dir) / "metrics.jsonl"
    return sum(1 for line in open(path) if line.endswith("\n")) if path.is_file() else 0


def test_fresh_dense_sign_changes_nothing_bitwise(eight, tmp_path):
    """Dense codec, the anchor firing every step on the current weights and batch (c = 1, K = 0, sync,
    β_M = 0 so M is this fire's G_anc alone): sign(M) is then the trainer's own gradient's sign on
    every coordinate, so the correction must
    leave the whole run bit for bit equal to the run without the anchor (the `eight` fixture).
    A sign landing on the wrong coordinate, a wrong stage or a stale fire breaks both checks."""
    launch(8, tmp_path, "anchor.enabled=true", "anchor.every=1", "anchor.staleness=0", "anchor.beta_m=0",
           "train.probe_every=1")
    r = rows(tmp_path)
    # the fixture probes at step 0 only, this run at every step: equality also shows the dense
    # probe's forward + backward leaves the trajectory alone
    assert [x["anchor/sign_agreement"] for x in r] == [1.0] * 4
    assert [x["anchor/age"] for x in r] == [0.0] * 4 and [x["anchor/fire"] for x in r] == [0.0, 1.0, 2.0, 3.0]
    ref, got = exported(eight), exported(tmp_path)
    assert ref.keys() == got.keys()
    assert all(torch.equal(ref[n], got[n]) for n in ref)
    # a fire's sign file per stage: the fixed header plus ⌈P_stage/8⌉ bytes
    last = published_fires(tmp_path / "anchor")[-1]
    for s in range(8):
        shard = load_file(str(tmp_path / "model" / f"model-{s + 1:05d}-of-00008.safetensors"))
        p = sum(t.numel() for t in shard.values())
        assert (sign_dir(tmp_path / "anchor", last) / f"stage{s}.sign").stat().st_size == HEADER_BYTES + math.ceil(p / 8)
    log = (tmp_path / "anchor" / "anchor.log").read_text()
    assert "fire 3: replayed θ(3)" in log and "STOP found" in log


@pytest.mark.parametrize("precision", ["zero1", "bf16"])
def test_flat_partitions_get_the_same_bits(tiny_model, tmp_path, precision):
    """ZeRO-1 and bf16 step flat fp32 partitions: the sign bits must reach each parameter's slice of
    them. With the fresh own-gradient sign (dense codec, c = 1, K = 0) every coordinate must agree
    (ZeRO-1 in fp32; for bf16 the anchor's fp32 signs can differ where the bf16 gradient rounds
    differently). Agreement is counted inside the wrapped step, on each replica's own partition, so a
    bit on the wrong slice shows as disagreement; an agreeing sign leaves AdamW bitwise unchanged
    (test_anchor_math), and 4×2 against 4×1 under ZeRO-1 with the anchor is tests/test_faults.py's."""
    cfg = json.loads(TINY.read_text())
    cfg.update({"zero_optimization": {"stage": 1}} if precision == "zero1" else {"bf16": {"enabled": True}})
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg))
    # 2 stages × 2 data-parallel replicas: ZeRO-1 really partitions each stage's flat group across
    # its replicas, and every replica of a stage must get that stage's bits
    launch(4, tmp_path / "anchor", stages(2), "anchor.enabled=true", "anchor.every=1", "anchor.staleness=0",
           "anchor.beta_m=0", config=path)
    r = rows(tmp_path / "anchor")
    if precision == "zero1":
        assert [x["anchor/sign_agreement"] for x in r] == [1.0] * 4
    else:
        assert all(x["anchor/sign_agreement"] > 0.9 for x in r), [x["anchor/sign_agreement"] for x in r]


def test_stale_sign_moves_the_run_and_reports_bytes(eight, tmp_path):
    """The same run with a held, stale sign (c = K = 2) must differ from the plain one, agree on
    fewer than all coordinates, and count its traffic: θ and the batch up, ⌈P/8⌉ + headers down.
    The anchor is external here: started by hand, before the trainer, as a user on another host would."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    anchor = subprocess.Popen([sys.executable, str(ROOT / "launch" / "anchor.py"), "--mailbox", str(tmp_path / "anchor")],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        launch(8, tmp_path, "anchor.enabled=true", "anchor.external=true", "anchor.every=2", "anchor.staleness=2",
               "train.probe_every=1")
        out, _ = anchor.communicate(timeout=60)              # the trainer's STOP ends it
    finally:
        anchor.kill()
    assert anchor.returncode == 0 and "fire 2: replayed θ(0)" in out and "STOP found" in out, out[-2000:]
    r = rows(tmp_path)
    assert r[0]["anchor/sign_agreement"] == 1.0            # fire 0 replays step 0 itself
    assert all(x["anchor/sign_agreement"] < 0.99 for x in r[1:])
    assert [x["anchor/age"] for x in r] == [0.0, 1.0, 2.0, 3.0]
    ref, got = exported(eight), exported(tmp_path)
    assert any(not torch.equal(ref[n], got[n]) for n in ref)
    p_total = sum(t.numel() for t in ref.values())
    assert r[0]["anchor/bytes_down"] == 8 * HEADER_BYTES + sum(
        math.ceil(sum(t.numel() for t in load_file(str(f)).values()) / 8)
        for f in sorted((tmp_path / "model").glob("model-*.safetensors")))
    assert r[0]["anchor/bytes_up"] > 4 * p_total             # fp32 θ plus the batch
    assert r[1]["anchor/bytes"] == 0.0                       # nothing crosses between fires
    # dense codec: the compressed gradient is the dense one; a stale sign pulls the corrected one away
    assert all(abs(x["grad/cos_comp_dense"] - 1.0) < 1e-6 for x in r)
    assert all(x["grad/cos_corrected_dense"] < 0.9 for x in r[1:])


def hold_ranks_until(proc, mailbox, killed: set, done, what: str, timeout: float = 180) -> None:
    """Once an anchor not in `killed` runs, SIGSTOP the launch's trainer ranks until `done()`, then
    SIGCONT them: the anchor catches up without racing the trainer."""
    deadline = time.time() + timeout
    while (pid := int((mailbox / "anchor.pid").read_text() or 0)) in killed or not psutil.pid_exists(pid):
        assert time.time() < deadline and proc.poll() is None, "no anchor running"
        time.sleep(0.05)
    ranks = []
    for p in psutil.Process(proc.pid).children(recursive=True):
        try:
            if p.pid != pid and any(a.endswith("train.py") for a in p.cmdline()):
                p.suspend()
                ranks.append(p)
        except psutil.NoSuchProcess:
            pass
    try:
        while not done():
            assert time.time() < deadline, f"the anchor did not {what}"
            time.sleep(0.05)
    finally:
        for p in ranks:
            p.resume()


def test_anchor_killed_mid_run(tiny_model, tmp_path):
    """SIGKILL the anchor mid-run (async, lowrank codec, each fire replaying a keyed half of its
    batch's prompt groups), and every restarted one, until the trainer logs a step whose held sign
    is older than a fire's normal span (2c − 1): the trainer keeps stepping on the held sign and
    logs its growing age, restarts the anchor each time; the last restart resumes M and the bases
    from its state file and catches up; every step is logged and the run ends on its own. The bases
    the anchor refreshes travel with each sign and are adopted by both ends of every cut (a
    non-orthonormal or mismatched basis would stop the run). The outage ends on what it must show,
    not after a number of steps: a fire's inputs are shipped K = c steps early, so an anchor that
    got ahead before the outage covers part of it, by as much as this machine's speed allows. Twice
    the trainer's ranks are held (SIGSTOP) while the anchor works: until the first anchor publishes
    its first sign, and after the outage until the last restart has published the fire due at their
    step. An anchor starting beside 8 busy ranks took ~30 s in clean CI (the first sign landed as
    late as step 21), and how fast it starts is this machine's load, not what is tested; from then
    on it must keep up by itself."""
    steps, c = 24, 4
    normal = c + c - 1                                       # the oldest a sign gets between fires
    cmd, env = launch_cmd(8, tmp_path, "anchor.enabled=true", f"anchor.every={c}", f"anchor.staleness={c}",
                          "anchor.mode=async", "anchor.max_restarts=50", "anchor.replay_fraction=0.5",
                          "codec.name=lowrank", "codec.keep=4",
                          f"train.steps={steps}", "train.eval_every=100", "train.save_every=0", "train.probe_every=0")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    mailbox, killed = tmp_path / "anchor", set()
    try:
        deadline = time.time() + 240
        while not (mailbox / "fire").is_dir() or not any((mailbox / "fire").glob("step*.json")):
            assert time.time() < deadline and proc.poll() is None, "the trainer never shipped a fire's inputs"
            time.sleep(0.05)
        hold_ranks_until(proc, mailbox, killed, lambda: published_fires(mailbox), "publish its first sign")
        start = logged_steps(tmp_path)                       # the first sign is held from here on
        while not any(x.get("anchor/age", 0) > normal for x in complete_rows(tmp_path)):
            pid = int((mailbox / "anchor.pid").read_text() or 0)   # 0 while the trainer rewrites it
            if pid and pid not in killed:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            assert time.time() < deadline and proc.poll() is None, "the trainer stopped stepping"
            time.sleep(0.05)
        caught_up = logged_steps(tmp_path)                   # the step the ranks are held in
        hold_ranks_until(proc, mailbox, killed, lambda: any(f >= (caught_up // c) * c for f in published_fires(mailbox)),
                         f"publish fire {(caught_up // c) * c} after its restart")
        out, _ = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, out[-3000:]
    r = rows(tmp_path)
    assert [x["step"] for x in r] == list(range(1, steps + 1))
    # async: no age before the first sign lands (when depends on how fast the anchor starts here);
    # from then on a sign is held on every step, through the outage
    held = [i for i, x in enumerate(r) if "anchor/age" in x]
    assert held and held[0] <= start + 1 and held == list(range(held[0], steps)), (start, held)
    ages = [x["anchor/age"] for x in r[held[0]:]]
    assert killed and r[-1]["anchor/restarts"] == len(killed)
    assert caught_up < steps - 1 and ages[-1] <= normal, (caught_up, ages)   # caught up after the restart
    # the lowrank codec end to end: reference and policy through the same basis, a real gap, k/d bytes back
    assert r[0]["actor/kl_loss"] == 0.0 and r[0]["rollout_corr/kl"] > 1e-3
    assert all(x["codec/bytes_bwd"] == x["codec/dense_equiv_bytes_bwd"] * 4 / 32 for x in r)
    log = (mailbox / "anchor.log").read_text()
    assert "resumed M from" in log, log[-2000:]
    assert "on 32 sequences" in log and "on 64 sequences" not in log   # replay_fraction: 8 of 16 prompts × 4
    states = sorted((mailbox / "state").glob("step*.json"))
    assert len(states) == 2                                  # the last two fires' states are kept
    state = json.loads(states[-1].read_text())
    assert state["step"] == max(f for f in range(0, steps, c))
    assert sorted(n for n in state["shapes"] if n.startswith("basis.")) == [f"basis.cut{l}" for l in range(7)]
    last = published_fires(mailbox)[-1]
    assert (sign_dir(mailbox, last) / "bases.safetensors").is_file()
