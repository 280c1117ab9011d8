"""Faults on real launches: non-finite steps skipped on every rank (pipeline/guard.py); crashes of a stage,
of the anchor and trainer together, and during a checkpoint save, each followed by --resume."""
import json
import math
import os
import random
import signal
import subprocess
import time

import psutil
import pytest
import torch
from conftest import ANCHORED, ROOT, VOLATILE, rank_processes, assert_resumed_rows, assert_rows_close, assert_same_weights, launch, launch_cmd, rows, weights

pytestmark = pytest.mark.dist

INJECT = "DS_TWOCIRCUIT_INJECT_NONFINITE"


def test_nonfinite_steps_are_skipped_on_every_stage_and_too_many_in_a_row_stop_the_run(tiny_model, tmp_path):
    """NaN written into stage 3's gradient at step 2 (t = 1), then into stage 5's at steps 4 and 5,
    with train.max_skipped_steps=2. Step 2 is skipped on all 8 stages: no stage's weights move (their
    distance from θ₀ is step 1's, bit for bit), the row says so and names the stage, one line is
    printed, and step 3 trains again. Steps 4 and 5 are two in a row: after logging step 5 the run
    stops with one line naming the key, a non-zero status and no traceback."""
    p = launch(8, tmp_path, "train.steps=8", "train.save_every=0", "train.max_skipped_steps=2",
               env={INJECT: "3@1,5@3,5@4"}, check=False)
    out = p.stdout + p.stderr
    assert p.returncode != 0 and "Traceback" not in out, out[-3000:]
    r = rows(tmp_path)
    assert [x["train/skipped_step"] for x in r] == [0.0, 1.0, 0.0, 1.0, 1.0]
    assert [x["train/nonfinite_stage"] for x in r] == [-1.0, 3.0, -1.0, 5.0, 5.0]
    for s in range(8):
        key = f"weights/rel_change/stage{s}"
        assert r[1][key] == r[0][key], key                       # nothing moved at the skipped step
        assert r[2][key] != r[1][key], key                       # and the next step trains again
        assert r[4][key] == r[3][key] == r[2][key], key
    assert r[1]["actor/grad_norm"] != r[1]["actor/grad_norm"]     # NaN: no norm for a skipped step
    assert math.isnan(r[1]["actor/grad_norm_clipped"]) and not math.isnan(r[0]["actor/grad_norm_clipped"])
    assert "step 2: non-finite loss or gradient on stage(s) [3]: optimizer step skipped on every rank (1 in a row)" in out
    lines = [l for l in out.splitlines() if "training stopped:" in l]
    assert len(lines) == 1, out[-3000:]
    assert "2 steps in a row skipped" in lines[0] and "train.max_skipped_steps=2" in lines[0]


def test_nonfinite_step_is_skipped_under_bf16_zero1_with_replicas_and_the_anchor(tiny_model, tmp_path):
    """The 1.5B recipe's precision: bf16, ZeRO-1, 2 stages x 2 data-parallel replicas, the anchor on
    (sync, every step), a warm-up LR schedule (its rates large enough to move bf16 weights). NaN in stage 0's gradient at step 2: DeepSpeed's own
    overflow check (bf16.check_grad_overflow, which pipeline/engine.py turns on) skips the step on every stage
    and replica, the row names stage 0, and between the checkpoints of steps 1 and 2 nothing moved:
    every replica's weights, fp32 master partitions, AdamW moments and step counts, and the LR
    schedule's tick are bit for bit equal, while step 3 trains again."""
    cfg = json.loads((ROOT / "tests/configs/tiny.json").read_text())
    cfg.update(bf16={"enabled": True}, zero_optimization={"stage": 1},
               scheduler={"type": "WarmupLR", "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 2e-3,
                                                         "warmup_num_steps": 10, "warmup_type": "linear"}})
    (tmp_path / "bf16.json").write_text(json.dumps(cfg))
    run = tmp_path / "run"
    out = launch(4, run, "model.layers_per_stage=[4,4]", "anchor.enabled=true", "anchor.mode=sync", "anchor.every=1",
                 "anchor.staleness=1", "anchor.timeout=60", "train.steps=3", "train.save_every=1", "train.eval_every=100",
                 config=tmp_path / "bf16.json", env={INJECT: "0@1"}).stdout
    # DeepSpeed 0.19.8 sums bf16 + ZeRO-1 gradients in bf16 unless told otherwise (engine_config tells it)
    assert "[deepspeed] BF16_Optimizer: weights in bfloat16, gradients accumulated in float32" in out, out[-3000:]
    r = rows(run)
    assert [x["train/skipped_step"] for x in r] == [0.0, 1.0, 0.0]
    assert [x["train/nonfinite_stage"] for x in r] == [-1.0, 0.0, -1.0]
    for s in range(2):
        key = f"weights/rel_change/stage{s}"
        assert r[1][key] == r[0][key] != r[2][key], key
    load = lambda tag, name: torch.load(run / "checkpoints" / tag / name, map_location="cpu", weights_only=False)
    files = sorted(f.name for f in (run / "checkpoints" / "step1").glob("*.pt"))
    assert sum("optim_states" in f for f in files) == 4, files          # one ZeRO-1 partition per rank
    moved = set()
    for name in files:
        a, b, c = (load(tag, name) for tag in ("step1", "step2", "step3"))
        if "_model_states" in name and name.startswith("mp_rank"):     # the engine's counters, per stage
            assert (a["skipped_steps"], b["skipped_steps"], c["skipped_steps"]) == (0, 1, 1), name
            assert a["lr_scheduler"] == b["lr_scheduler"] != c["lr_scheduler"], name
        else:                                    # weights (layer_*), fp32 partitions and moments (optim_states)
            assert _tensors(a) == _tensors(b), name
            moved |= {name} if _tensors(c) != _tensors(b) else set()
    assert {f for f in files if "optim_states" in f} <= moved and any(f.startswith("layer_") for f in moved)


def _tensors(tree) -> list:
    """Every tensor and number in a checkpoint's state, flattened in order, as comparable bytes; but
    the optimizer's `overflow` flag, which records the skip itself."""
    if isinstance(tree, torch.Tensor):
        return [(tree.dtype, tuple(tree.shape), tree.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())]
    if isinstance(tree, dict):
        return [x for k in sorted(tree, key=str) if k != "overflow" for x in [str(k)] + _tensors(tree[k])]
    if isinstance(tree, (list, tuple)):
        return [x for v in tree for x in _tensors(v)]
    return [tree] if isinstance(tree, (int, float, bool, str)) or tree is None else []


# ---- crash consistency of the two circuits (anchor/mailbox.py: rewind) -------------------------


def _trainer_procs(launcher: psutil.Process) -> dict[int, psutil.Process]:
    """Global rank → the launch's train.py process."""
    return rank_processes(launcher.pid)


def _run_until_killed(tmp_path, after_rows: int, kill, env=None) -> float:
    """A resumed launch; once `after_rows` rows are logged, wait a random part of the first half of
    a step, then kill(launcher); the launch must end by itself. → the delay used (for the failure
    message). Half: on a busy machine step times vary, and a whole step's wait outlasted the last two
    steps of a run once (the launch had ended before the kill)."""
    cmd, env = launch_cmd(8, tmp_path, *ANCHORED, resume=True, env=env)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    delay = -1.0
    try:
        deadline = time.time() + 240
        while len(_rows_now(tmp_path)) < after_rows and proc.poll() is None:
            assert time.time() < deadline, "the launch stopped stepping"
            time.sleep(0.05)
        if proc.poll() is None:
            delay = random.uniform(0, 0.5 * _rows_now(tmp_path)[-1]["timing/step"])
            time.sleep(delay)
            assert proc.poll() is None, (f"the launch ended before the kill, {delay:.2f} s after row {after_rows} "
                                         f"(rc {proc.returncode}): " + proc.communicate()[0][-3000:])
            kill(psutil.Process(proc.pid))
        proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode != 0, "the launch was meant to die"
    return delay


def _rows_now(run_dir):
    path = run_dir / "metrics.jsonl"
    return [json.loads(l) for l in path.read_text().splitlines() if l.endswith("}")] if path.is_file() else []


def _kill_rank(rank):
    def kill(launcher):
        _trainer_procs(launcher)[rank].send_signal(signal.SIGKILL)
    return kill


def _kill_anchor_and_trainer(mailbox):
    def kill(launcher):
        os.kill(int((mailbox / "anchor.pid").read_text()), signal.SIGKILL)
        for p in [*_trainer_procs(launcher).values(), launcher]:
            p.send_signal(signal.SIGKILL)
    return kill


@pytest.fixture(scope="module")
def crashed(anchored, tmp_path_factory):
    """ANCHORED (sync mode, anchor on, c = K = 2, a checkpoint every 3 of 12 steps): one run dir taken
    through three crashes and four resumes: a middle stage (rank 3) SIGKILLed at a random point of
    step 5; rank 3 killed as the checkpoint of step 9 starts (the others are writing theirs, so
    `latest` must still name step 6); the anchor and every trainer process killed together at a
    random point of step 11; then a last resume to the end. → (run dir, the random delays used)."""
    run = tmp_path_factory.mktemp("crashed")
    mailbox = run / "anchor"
    cmd, env = launch_cmd(8, run, *ANCHORED)
    first = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:   # the first launch is a fresh one: the same kill as _run_until_killed's
        while len(_rows_now(run)) < 4:
            assert first.poll() is None, first.communicate()[0][-3000:]
            time.sleep(0.05)
        delays = [random.uniform(0, _rows_now(run)[-1]["timing/step"])]
        time.sleep(delays[0])
        _kill_rank(3)(psutil.Process(first.pid))
        first.communicate(timeout=120)
    finally:
        first.kill()
    assert first.returncode != 0
    assert (run / "checkpoints" / "latest").read_text().strip() == "step3"
    _run_until_killed(run, 10, lambda launcher: None, env={"DS_TWOCIRCUIT_KILL_AT": "save@9@3"})
    assert (run / "checkpoints" / "latest").read_text().strip() == "step6", "a partial checkpoint was named"
    delays.append(_run_until_killed(run, 10, _kill_anchor_and_trainer(mailbox)))
    assert (run / "checkpoints" / "latest").read_text().strip() == "step9"
    launch(8, run, *ANCHORED, resume=True)
    return run, delays


def test_crashes_then_resume_continue_the_uninterrupted_trajectory(anchored, crashed):
    """The crashed run dir's rows (each written by the launch that last reached that step), its
    held-out evaluations and its weights equal the uninterrupted run's bit for bit (this is also
    the plain resume test: every random draw is keyed by the step)."""
    ref, (run, delays) = anchored, crashed
    want, got = rows(ref), rows(run)
    print("kill delays (s):", delays)
    assert [x["step"] for x in got] == list(range(1, 13))
    assert_resumed_rows(want, got, restarts={4, 7, 10}, volatile=VOLATILE)
    assert rows(ref, "eval.jsonl") == rows(run, "eval.jsonl")
    wa, wb = weights(ref), weights(run)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[n], wb[n]) for n in wa)
    log = (run / "anchor" / "anchor.log").read_text()
    assert log.count("reloading") == 0 and "resumed M from" in log, log[-2000:]


def test_resumed_launches_wait_for_the_anchor_no_longer_than_a_fresh_one(anchored, crashed):
    """Wall clock, on the same crashed run dir: no step waits for the anchor longer than the
    uninterrupted run's longest wait (its first fire, which waits for the anchor process to start)
    and a margin: 5 s, or 15 s for a launch's first wait, which starts an anchor too and may replay
    the held fire beside 8 starting ranks (clean CI, loaded: 11.5 and 12.7 s against step 1's
    6.5 s). A fire lost to a crash would wait anchor.timeout = 60 s."""
    (run, delays), want = crashed, rows(anchored)
    start_up = max(x["anchor/wait"] for x in want)
    waits = {x["step"]: x["anchor/wait"] for x in rows(run)}
    launches = [range(1, 4), range(4, 7), range(7, 10), range(10, 13)]   # the steps each launch wrote
    first = {max(steps, key=waits.get) for steps in launches}            # its start-up wait
    assert all(waits[s] <= start_up + 15.0 for s in first), (waits, delays)
    assert all(w <= start_up + 5.0 for s, w in waits.items() if s not in first), (waits, delays)


# ---- data parallelism end to end ----------------------------------------------------------------
def test_two_replicas_equal_one_on_the_same_global_batch(tiny_model, tmp_path):
    """4 stages × 2 data-parallel replicas (8 ranks) against 4 stages × 1 (4 ranks), ZeRO-1, the
    anchor on (sync, c = K = 2), PRF codec, the same 64 sequences per step: each replica trains on
    half of them (gradient accumulation halves), DeepSpeed averages the replicas' gradients and
    ZeRO-1 splits each stage's optimizer state between them. Losses, KL and entropy equal to float
    tolerance (rel 1e-4: the replicas sum in another order, and PRF's 25 % masks amplify it over 4
    steps; measured 2026-12-06: KL 2.4e-5, gradient norm 5e-6, the rest ≤ 1e-7), the anchor's sign
    agrees as closely, and the weights match to assert_same_weights's tolerance."""
    cfg = json.loads((ROOT / "tests/configs/tiny.json").read_text())
    cfg["zero_optimization"] = {"stage": 1}
    path = tmp_path / "zero1.json"
    path.write_text(json.dumps(cfg))
    common = ("model.layers_per_stage=[2,2,2,2]", "codec.name=prf", "anchor.enabled=true", "anchor.mode=sync",
              "anchor.every=2", "anchor.staleness=2", "train.save_every=0", "train.probe_every=0")
    launch(4, tmp_path / "dp1", *common, config=path)
    launch(8, tmp_path / "dp2", *common, config=path)
    one, two = rows(tmp_path / "dp1"), rows(tmp_path / "dp2")
    assert [x["step"] for x in two] == [1, 2, 3, 4]
    assert_rows_close(one, two, ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm",
                                 "anchor/sign_agreement", "critic/score/mean"), rel_tol=1e-4)
    assert [a["anchor/fire"] for a in one] == [b["anchor/fire"] for b in two]
    assert_same_weights(weights(tmp_path / "dp1"), weights(tmp_path / "dp2"))
