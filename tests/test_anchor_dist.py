"""The anchor circuit on real launches: 8 DeepSpeed CPU ranks plus the separate anchor process."""
import json
import math
import os
import pathlib
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, TINY, assert_clipped_norms, launch, rows, stages
from safetensors.torch import load_file

from ds_twocircuit.anchor.mailbox import metadata, published_fires, sign_dir, sign_path

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
    # a fire's sign file per stage: ⌈P_stage/8⌉ bytes of bits under a header of less than 1 KiB
    last = published_fires(tmp_path / "anchor")[-1]
    for s in range(8):
        shard = load_file(str(tmp_path / "model" / f"model-{s + 1:05d}-of-00008.safetensors"))
        p = sum(t.numel() for t in shard.values())
        path = sign_path(tmp_path / "anchor", last, s)
        assert load_file(str(path))["bits"].numel() == math.ceil(p / 8)
        assert 0 < path.stat().st_size - math.ceil(p / 8) < 1024
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
    # DeepSpeed's own clip on its flat partitions. Under bf16 the gradient it steps measures up to
    # 3e-4 below max_norm (0.049986 at step 2, measured): DeepSpeed's norm of its bf16 optimizer's
    # groups is not exactly the norm of the partitions it steps; a clip that does not bind is off by 7×
    assert_clipped_norms(r, 0.05, rel_tol=1e-4 if precision == "zero1" else 1e-3)
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
    bits = sum(math.ceil(sum(t.numel() for t in load_file(str(f)).values()) / 8)
               for f in sorted((tmp_path / "model").glob("model-*.safetensors")))
    assert bits < r[0]["anchor/bytes_down"] < bits + 8 * 1024    # the bits and 8 headers of < 1 KiB
    assert r[0]["anchor/bytes_up"] > 4 * p_total             # fp32 θ plus the batch
    assert r[1]["anchor/bytes"] == 0.0                       # nothing crosses between fires
    # dense codec: the compressed gradient is the dense one; a stale sign pulls the corrected one away
    assert all(abs(x["grad/cos_comp_dense"] - 1.0) < 1e-6 for x in r)
    assert all(x["grad/cos_corrected_dense"] < 0.9 for x in r[1:])


def test_anchor_killed_at_given_fires(tiny_model, tmp_path):
    """The anchor SIGKILLed at given fires (run/faults.py, in sync mode, so every step's held sign is
    known): c = 4, K = 0 (fire f replays θ(f), shipped at step f, so the anchor cannot work ahead
    of the trainer), lowrank codec, each fire replaying a keyed half of its batch's prompt groups.
    The first anchor dies as it starts fire 8, and so does its first restart; the second restart
    publishes fire 8 and dies as it starts fire 12; the third publishes fire 12 and serves to the
    end. The trainer restarts it each time and steps on the held sign meanwhile, its age growing
    past a fire's normal span (c − 1); each restart resumes M and the bases from the state file of
    the last fire that published; every step is logged and the run ends on its own. The bases
    travel with each sign and both ends of every cut adopt them (a non-orthonormal or mismatched
    basis would stop the run)."""
    steps, c = 16, 4
    launch(8, tmp_path, "anchor.enabled=true", f"anchor.every={c}", "anchor.staleness=0", "anchor.mode=sync",
           "anchor.timeout=300", "anchor.max_restarts=5", "anchor.replay_fraction=0.5",
           "codec.name=lowrank", "codec.keep=4",
           f"train.steps={steps}", "train.eval_every=100", "train.save_every=0", "train.probe_every=0",
           env={"DS_TWOCIRCUIT_KILL_AT": "fire@8@anchor0,fire@8@anchor1,fire@12@anchor2"}, timeout=500)
    r = rows(tmp_path)
    assert [x["step"] for x in r] == list(range(1, steps + 1))
    # the held fire at each step t: fire 8 lands at step 10 (its third try), fire 12 at step 13
    held = [0] * 4 + [4] * 6 + [8] * 3 + [12] * 3
    assert [x["anchor/fire"] for x in r] == held
    assert [x["anchor/age"] for x in r] == [t - f for t, f in enumerate(held)]
    assert max(x["anchor/age"] for x in r) == 5 > c - 1                   # the outage, seen in the rows
    assert [x["anchor/restarts"] for x in r] == [0] * 8 + [1, 2, 2, 2, 3, 3, 3, 3]
    # the lowrank codec end to end: reference and policy through the same basis, a real gap, k/d bytes back
    assert r[0]["actor/kl_loss"] == 0.0 and r[0]["rollout_corr/kl"] > 1e-3
    assert all(x["codec/bytes_bwd"] == x["codec/dense_equiv_bytes_bwd"] * 4 / 32 for x in r)
    mailbox = tmp_path / "anchor"
    log = (mailbox / "anchor.log").read_text()
    assert log.count("resumed M from") == 3 and "resumed M from" in log.split("fire 8: replayed")[0], log[-3000:]
    assert "on 32 sequences" in log and "on 64 sequences" not in log   # replay_fraction: 8 of 16 prompts × 4
    states = sorted((mailbox / "state").glob("step*.safetensors"))
    assert len(states) == 2                                  # the last two fires' states are kept
    state = metadata(states[-1])
    assert int(state["step"]) == max(f for f in range(0, steps, c))
    names = json.loads(state["tensors"])
    assert sorted(n for n in names if n.startswith("basis.")) == [f"basis.cut{l}" for l in range(7)]
    assert (sign_dir(mailbox, published_fires(mailbox)[-1]) / "bases.safetensors").is_file()
