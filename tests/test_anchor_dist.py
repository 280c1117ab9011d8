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
    assert all(x["anchor/alive"] == 1.0 for x in r)                      # within its restarts throughout
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


@pytest.mark.parametrize("on_failure", ["stop", "continue"])
def test_an_anchor_out_of_restarts_stops_or_continues_as_asked(tiny_model, tmp_path, on_failure):
    """The managed anchor dies as it starts fire 2 with no restart left (anchor.max_restarts=0).
    anchor.on_failure=stop: every rank ends at that step with one error naming the key, the steps
    before it logged with the anchor alive. continue: the run ends on its own, holding fire 0's sign,
    with anchor/alive 0 from the step the anchor was given up."""
    p = launch(8, tmp_path, "anchor.enabled=true", "anchor.every=2", "anchor.staleness=0", "anchor.mode=sync",
               "anchor.timeout=300", "anchor.max_restarts=0", f"anchor.on_failure={on_failure}", "train.steps=4",
               "train.eval_every=100", "train.save_every=0", "train.probe_every=0",
               env={"DS_TWOCIRCUIT_KILL_AT": "fire@2@anchor0"}, timeout=300, check=False)
    out, r = p.stdout + p.stderr, rows(tmp_path)
    if on_failure == "stop":
        assert p.returncode != 0 and "anchor.on_failure=stop" in out, out[-3000:]
        assert [x["step"] for x in r] == [1, 2] and all(x["anchor/alive"] == 1.0 for x in r), r
    else:
        assert p.returncode == 0, out[-3000:]
        assert [x["step"] for x in r] == [1, 2, 3, 4] and [x["anchor/fire"] for x in r] == [0] * 4
        assert [x["anchor/alive"] for x in r] == [1.0, 1.0, 0.0, 0.0], r


def test_memory_forecast_and_a_codec_on_one_cut(tiny_model, tmp_path):
    """c = 1, K = 1 with the forecast (`anchor.forecast`), β_M = 0.3, sync; the trainer's PRF codec
    on cut 3 alone (`codec.boundaries=[3]`), every second step dense (`train.dense_every=2`); each
    group's prompt crossing every cut once (`grpo.share_prompts`, trainer and anchor); sampling
    temperature 0.7, which every log-prob of the run must use.

    - fire t is held from step t on, at age 1 (it replays θ(t − 1));
    - fire 3 replays θ̂ = θ(2) + (K/c)(θ(2) − θ(1)) on the batch θ(2) generated: its saved M equals
      β_M·M(fire 2) + (1 − β_M)·G, G computed in this process with the HF model at θ̂ (from the
      mailbox's θ files) plus `grpo_token_loss` at τ = 0.7, the reference from the base model, with
      nothing shared (the anchor is dense, so sharing changes only float order). Bound 1e-6
      absolute (measured 7.5e-9, max |M| 0.08): a memory that forgets M is off by β_M·M, swapped
      coefficients by (1 − 2β_M)(M − G), a replay at θ(2) instead of θ̂ by 9.6e-3 (measured);
    - the wire: cut 3 sends exactly k/d of the dense gradient bytes back, the other cuts and every
      cut of a dense step all of them;
    - τ reaches every log-prob: at step 1 the policy is the reference (KL exactly 0, both through
      the same masks), and on a dense step the sampler's log-probs are the pipeline's to float noise."""
    import dist_objective as obj
    from ds_twocircuit.anchor import mailbox as mb
    from ds_twocircuit.grpo.loss import LossCoefs
    from ds_twocircuit.grpo.rollouts import Rollout
    beta = 0.3
    launch(8, tmp_path, "codec.name=prf", "codec.boundaries=[3]", "train.dense_every=2", "anchor.enabled=true",
           "anchor.mode=sync", "anchor.every=1", "anchor.staleness=1", "anchor.forecast=true", f"anchor.beta_m={beta}",
           "train.steps=4", "train.eval_every=100", "train.probe_every=0", "grpo.temperature=0.7",
           "grpo.share_prompts=true")
    r = rows(tmp_path)
    assert r[0]["actor/kl_loss"] == 0.0 and r[2]["actor/kl_loss"] > 0
    assert abs(r[1]["rollout_corr/kl"]) < 1e-5 and abs(r[3]["rollout_corr/kl"]) < 1e-5 and r[2]["rollout_corr/kl"] > 1e-4
    assert [x["anchor/fire"] for x in r] == [0, 1, 2, 3] and [x["anchor/age"] for x in r] == [0, 1, 1, 1]
    root = tmp_path / "anchor"
    assert "fire 3: replayed θ̂ from θ(2), θ(1)" in (root / "anchor.log").read_text()
    theta = {s: {n: t for i in range(8) for n, t in mb.read_theta(root, s, i).items()} for s in (1, 2)}
    hat = {n: theta[2][n].float() + (theta[2][n].float() - theta[1][n].float()) for n in theta[2]}
    batch = Rollout(**mb.read_tensors(mb.batch_path(root, 2), 2))
    with torch.no_grad():
        _, ref = obj.hf_logprobs(str(tiny_model), batch, 0.7)
    g, _ = obj.reference_gradients(str(tiny_model), batch, None, ref, LossCoefs(kl_coef=0.01), 0.7, hat)
    m2, m3 = (mb.read_tensors(mb.state_path(root, f), f) for f in (2, 3))
    assert g.keys() == m3.keys()
    for n in g:
        torch.testing.assert_close(m3[n], beta * m2[n] + (1 - beta) * g[n], rtol=0, atol=1e-6, msg=n)
    k, d = 2, 32                                         # keep_ratio 0.05 of 32 channels
    for x in r:
        per_cut = [x[f"codec/boundary{b}/bytes_bwd"] for b in range(7)]
        dense = per_cut[0]
        assert per_cut == [dense] * 3 + [dense if x["train/dense_step"] else dense * k / d] + [dense] * 3, per_cut
    assert [x["train/dense_step"] for x in r] == [0.0, 1.0, 0.0, 1.0]


def test_the_staleness_contract_at_c_equal_k_equal_2(anchored):
    """The two-circuit reference run (sync, c = K = 2, 12 steps): fire f is adopted at step f and
    replays θ(max(0, f − 2)), so the held fire is [0, 0, 2, 2, 4, 4, …] and the age t − (f − K)
    [0, 1, 2, 3, 2, 3, …] (fire 2 still replays θ(0)). Holding fire 0 throughout gives the same ages
    up to step 3 alone, so all 12 steps are pinned."""
    r = rows(anchored)
    assert [x["anchor/fire"] for x in r] == [0, 0, 2, 2, 4, 4, 6, 6, 8, 8, 10, 10]
    assert [x["anchor/age"] for x in r] == [0, 1, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3]
