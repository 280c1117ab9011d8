"""Equivalence tests on real DeepSpeed processes (the launcher, gloo, 8 CPU ranks).

- the pipeline's logits equal the HF model's (fp32, 1e-5), padding on both sides, two shapes;
- 1 stage and 8 stages give the same losses, grad norms and updated weights over 4 GRPO steps
  (the 8-stage run clips by the true global norm; the 1-stage run has only one stage to count);
- the loss does not change with the micro-batch split;
- a run stopped at step 2 and resumed writes the same metrics rows for steps 3–4.
"""
import json
import math
import os
import subprocess

import pytest
import torch

from conftest import ROOT, assert_clipped_norms, assert_rows_close, assert_same_weights, ds_cmd, launch, rows, stages, weights

pytestmark = pytest.mark.dist


@pytest.mark.parametrize("n_stages, model", [(8, "tiny_model"), (3, "fixtures")])
def test_pipeline_logits_match_hf(request, tmp_path, n_stages, model):
    """The embedded model at 8 stages; at 3 (3/3/2 layers), the Qwen2.5-layout fixture: grouped-query
    attention (4 query heads over 2 key-value heads), q/k/v biases, a byte-level BPE vocabulary."""
    model_dir = request.getfixturevalue(model)
    model_dir = str(model_dir["model"] if model == "fixtures" else model_dir)
    out = tmp_path / "logits.json"
    split = json.dumps([int(x) for x in stages(n_stages).split("=")[1].strip("[]").split(",")])
    p = subprocess.run(ds_cmd(n_stages, "tests/dist_logits.py", model_dir, split, out),
                       cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["stages"] == n_stages and res["max_abs_diff"] < 1e-5, res


def test_eight_stages_take_grpo_steps_and_export(eight, tiny_model):
    """Four GRPO steps through 8 stages: the clip is active, the first step is on the reference
    (KL 0, π_old = the sampler's θ), some advantage is non-zero, evaluations at 0, 2 and 4, and the
    export reloads with `from_pretrained` to the run's final weights. Not a learning test: this
    32-wide test model loses held-out accuracy under GRPO at the tests' lr (measured: 0.17 → 0.05
    over 30 dense steps at 4 stages); learning is measured on the embedded default (README)."""
    r = rows(eight)
    assert [x["step"] for x in r] == [1, 2, 3, 4]
    assert r[0]["actor/grad_norm"] > 0.05, "the clip must be active for the 1-vs-8 comparison to test it"
    assert_clipped_norms(r, 0.05)
    assert r[0]["actor/kl_loss"] == 0.0 and r[0]["actor/ppo_kl"] == 0.0
    assert abs(r[0]["rollout_corr/kl"]) < 1e-5
    assert any(x["actor/pg_loss"] != 0 for x in r), "advantages all zero: the test batch carries no signal"
    assert [e["step"] for e in rows(eight, "eval.jsonl")] == [0, 2, 4]
    from ds_twocircuit.run import provenance      # what the run was made from, for tables across runs
    (launch_entry,) = provenance.read(eight)
    assert launch_entry["step"] == 0 and launch_entry["machine"]["world_size"] == 8
    assert launch_entry["start"]["weights_sha256"] == provenance.weights_digest(tiny_model)[0]
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(eight / "model")
    w = weights(eight)
    for n, p in m.named_parameters():
        assert torch.equal(p.detach(), w[n]), n


def test_one_stage_equals_eight_stages(eight, tmp_path):
    """Rows within 1e-4 relative (measured 2026-12-06: ≤ 1.7e-7, the stages sum in another order;
    the clipped norm 4e-9), weights to assert_same_weights's bound."""
    launch(1, tmp_path, stages(1))
    assert_rows_close(rows(eight), rows(tmp_path), ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm",
                                                    "actor/grad_norm_clipped", "actor/entropy", "critic/score/mean"),
                      rel_tol=1e-4)
    assert_same_weights(weights(eight), weights(tmp_path))


def test_micro_batch_split_does_not_change_the_loss(eight, tmp_path):
    """16 micro-batches of 2 against 4 of 8: rows within 1e-4 relative (measured ≤ 5e-7: the token
    mean sums its micro-batches in another order), weights to assert_same_weights's bound."""
    cfg = json.loads((ROOT / "tests/configs/tiny.json").read_text())
    cfg["train_micro_batch_size_per_gpu"] = 2        # 16 micro-batches instead of 4
    path = tmp_path / "micro2.json"
    path.write_text(json.dumps(cfg))
    launch(8, tmp_path / "run", config=path)
    assert_rows_close(rows(eight), rows(tmp_path / "run"), ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm"),
                      rel_tol=1e-4)
    assert_same_weights(weights(eight), weights(tmp_path / "run"))


def test_the_rollout_correction_against_a_dense_fp32_sampler_is_the_uncorrected_run(eight, tmp_path):
    """Codec off, an fp32 sampler, staleness 0: π_old/μ is the dense fp32 gap alone, so with the
    correction on (rejection bounds too) every weight is 1 within it, nothing is rejected, and the
    run is the uncorrected one: rows within 1e-4 relative (measured 2026-12-06: ≤ 1.6e-6), weights to
    assert_same_weights's bound. On the probe step the gap's split puts all of it in the numerics:
    the codec's share is exactly 0 (the same dense passes), numerics + codec = rollout_corr/kl."""
    launch(8, tmp_path, "grpo.rollout_correction.enabled=true", "grpo.rollout_correction.rollout_rs_token=[0.5,2]",
           "grpo.rollout_correction.rollout_rs_geometric=[0.999,1.001]")
    on = rows(tmp_path)
    for x in on:
        assert abs(x["rollout_corr/rollout_is_mean"] - 1) < 1e-5 and x["rollout_corr/rollout_is_max"] < 1 + 1e-5, x["step"]
        assert x["rollout_corr/rollout_is_eff_sample_size"] > 1 - 1e-6, x["step"]      # fp32 sums: 1 − 1.2e-7 measured
        assert x["rollout_corr/rollout_rs_masked_fraction"] == 0.0 == x["rollout_corr/rollout_is_ratio_fraction_high"]
    assert "rollout_corr/rollout_is_mean" not in rows(eight)[0]
    assert_rows_close(rows(eight), on, ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/entropy",
                                        "critic/score/mean", "rollout_corr/kl"), rel_tol=1e-4)
    assert_same_weights(weights(eight), weights(tmp_path))
    probed = on[0]
    assert probed["mismatch/codec_kl"] == 0.0 == probed["mismatch/codec_logp_diff"]
    assert 0 < probed["mismatch/numerics_logp_diff"] < 1e-5
    assert math.isclose(probed["mismatch/numerics_kl"], probed["rollout_corr/kl"], rel_tol=1e-6, abs_tol=1e-12)
    assert "mismatch/codec_kl" not in on[1]                                   # probe steps only


def test_the_correction_and_the_split_over_replicas_and_left_out_groups(tiny_model, tmp_path):
    """4 stages × 2 replicas, zero-advantage groups left out (β = 0), a probe every step, codec off:
    each replica's last stage holds half the batch and only the kept rows enter its passes, yet the
    token weights behind every metric sum to 1 over both replicas' kept tokens, so the weights' mean
    is 1 within the fp32 gap (a replica's share miscounted makes it 0.5 or 2), the largest weight is
    read from both replicas' slots, and on every probe step the split, mapped from the probe's whole
    shard to the kept rows, puts the whole gap in the numerics: the codec's share is float order alone
    (the update's passes batch the kept rows, the probe's the whole shard: measured |Δ| 1e-7, bound
    1e-5; misaligned rows would read other tokens' log-probs, nats apart), and numerics + codec =
    rollout_corr/kl."""
    launch(8, tmp_path, stages(4), "grpo.kl_coef=0", "grpo.skip_zero_advantage=true",
           "grpo.rollout_correction.enabled=true", "train.steps=3", "train.probe_every=1")
    r = rows(tmp_path)
    assert any(x["train/skipped_groups"] > 0 for x in r), "no group left out: the test exercises nothing"
    for x in r:
        assert abs(x["rollout_corr/rollout_is_mean"] - 1) < 1e-5 and abs(x["rollout_corr/rollout_is_max"] - 1) < 1e-5
        assert x["mismatch/codec_logp_diff"] < 1e-5 and x["mismatch/numerics_logp_diff"] < 1e-5, x["step"]
        assert math.isclose(x["mismatch/numerics_kl"] + x["mismatch/codec_kl"], x["rollout_corr/kl"], rel_tol=1e-4,
                            abs_tol=1e-9), x["step"]


def test_the_staleness_split_over_replicas_and_left_out_groups(tiny_model, tmp_path):
    """The same layout a step ahead (rollout.staleness=1): the sampler's rescoring at θ_t reaches each
    replica's last stage sliced to its shard and mapped to its kept rows as the probe's log-probs are,
    so the numerics part (rescoring against the codec-off pipeline, both fp32) stays at float order on
    every probe step (a slice or row off reads other tokens, nats apart), the staleness part holds the
    gap once the batch is a step old, and the three parts add up."""
    launch(8, tmp_path, stages(4), "grpo.kl_coef=0", "grpo.skip_zero_advantage=true", "rollout.staleness=1",
           "train.steps=3", "train.probe_every=1")
    r = rows(tmp_path)
    assert any(x["train/skipped_groups"] > 0 for x in r), "no group left out: the test exercises nothing"
    for x in r:
        assert x["mismatch/numerics_logp_diff"] < 1e-5 and x["mismatch/codec_logp_diff"] < 1e-5, x["step"]
        parts = x["mismatch/staleness_kl"] + x["mismatch/numerics_kl"] + x["mismatch/codec_kl"]
        assert math.isclose(parts, x["rollout_corr/kl"], rel_tol=1e-4, abs_tol=1e-9), x["step"]
    assert [x["rollout/staleness"] for x in r] == [0.0, 1.0, 1.0]
    assert all(x["mismatch/staleness_logp_diff"] > 1e-3 for x in r[1:]), [x["mismatch/staleness_logp_diff"] for x in r]


def test_resume_refuses_a_corrupt_checkpoint_file_by_name(eight, tmp_path):
    """`latest` names a sealed checkpoint (one manifest per rank); one flipped byte in a layer file
    and `--resume` stops with one line naming that file, before any process group or new row."""
    import shutil
    import time
    run = tmp_path / "run"
    shutil.copytree(eight, run)
    ckpt = run / "checkpoints"
    assert (ckpt / "latest").read_text() == "step4" and len(list((ckpt / "step4").glob("manifest.rank*.json"))) == 8
    victim = max((ckpt / "step4").glob("layer_*"), key=lambda f: f.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 1
    victim.write_bytes(bytes(data))
    t0 = time.time()
    p = launch(8, run, "train.steps=6", resume=True, check=False, timeout=120)
    lines = [l for l in (p.stdout + p.stderr).splitlines() if l.startswith("checkpoint error:")]
    assert p.returncode != 0 and len(lines) == 1 and f"{victim} is corrupt" in lines[0], p.stdout[-3000:]
    assert time.time() - t0 < 30 and len(rows(run)) == 4


def test_several_ppo_mini_batches_use_pipeline_old_logprobs(eight, tmp_path):
    """Two PPO mini-batches per rollout, two epochs over them: π_old comes from a pipeline eval pass
    before any update, and the optimizer steps 2 × 2 times per rollout step (DeepSpeed's own count).
    The first mini-batch's train pass sees the same weights, so its ratio is exactly 1 on every
    token (Σ w·|log ρ| = 0, not merely small); the second sees the policy the first update moved
    (the step's mean ppo_kl is its alone, and non-zero); the eval pass's π_old equals the sampler's
    recompute of the same weights (HF, fp32) to float noise."""
    launch(8, tmp_path, "grpo.ppo_mini_batches=2", "grpo.ppo_epochs=2", "train.steps=2")
    r = rows(tmp_path)
    assert len(r) == 2
    state = torch.load(tmp_path / "checkpoints" / "step2" / "mp_rank_00_model_states.pt", weights_only=False)
    assert state["global_steps"] == 2 * 2 * 2 and state["skipped_steps"] == 0
    assert [x["actor/first_update_abs_log_ratio"] for x in r] == [0.0, 0.0]
    assert all(x["actor/ppo_kl"] != 0.0 and math.isfinite(x["actor/ppo_kl"]) for x in r)
    assert all(abs(x["rollout_corr/kl"]) < 1e-5 and x["rollout_corr/logp_diff_mean"] < 1e-5 for x in r)
    assert "actor/first_update_abs_log_ratio" not in rows(eight)[0]        # on-policy steps: no old pass


def test_the_wide_embedded_model_is_built_and_trained(cache_dir, tmp_path):
    """`model.embedded=wide` builds model.wide (its own cache entry, named `wide-<key>`) and trains on
    it: one rotated step through 8 stages on a narrowed copy of the block (the shipped d = 384 warm
    start takes most of an hour: a benchmark tier, not a test's). The export has model.wide's width."""
    wide = {"num_layers": 8, "hidden_size": 64, "num_heads": 1, "num_kv_heads": 1, "warmup_steps": 2, "warmup_batch": 8}
    launch(8, tmp_path, "model.embedded=wide", *(f"model.wide.{k}={v}" for k, v in wide.items()),
           "codec.name=rotated", "codec.bwd_coords=40", "train.steps=1", "train.eval_every=1", "train.save_every=0")
    assert [x["step"] for x in rows(tmp_path)] == [1]
    assert json.loads((tmp_path / "model" / "config.json").read_text())["hidden_size"] == 64
    assert [p.name for p in cache_dir.glob("wide-*") if p.is_dir()], list(cache_dir.iterdir())


def test_the_grpo_objective_as_the_pipeline_applies_it(tiny_model, tmp_path):
    """4 stages × 2 replicas run `passes.update` on a synthetic rollout (tests/dist_objective.py:
    ragged lengths, mixed-sign advantages, π_old and π_ref off π_θ, τ = 0.7, β = 0.05). Each stage's
    gradient equals the HF model's plus `grpo_token_loss` in one process, with micro-batches of one
    padded length (bound: 1e-5 relative, 1e-7 absolute, float summation order: measured 2026-12-06,
    at most 2.8e-7 of a tensor's largest element, the norm 7e-10 relative) and sorted by length and
    trimmed, where each micro-batch runs attention and the matmuls at its own length (bound: 1e-5
    relative plus 1e-5 of the tensor's largest element: measured 5.2e-6, in the attention's v and o
    projections). A flipped loss, advantages on the wrong rows, a lost temperature, a wrong scale or
    a pad attended move them by their own size. The clipped, corrected and direction passes run trimmed.
    With the rollout correction on (truncation, token and sequence rejection all binding) the gradient
    is the reference's with the same correction, the sampler's log-probs reaching the last stage as
    labels (the correction moves the gradient by over 5 % of its norm, so a lost or misaligned μ shows). With the
    true-norm clip at 0.01 the stepped gradient is the reference × 0.01/(‖g‖ + 1e-6) and the norm
    the clip read is the reference's (the tied embedding counted once). One on-policy AdamW step at
    β = 0 raises Σ Â·Δlog π over the responses, and raises the mean log π of the positive-advantage
    responses' tokens relative to the negative ones'."""
    import dataclasses

    import dist_objective as obj
    from safetensors.torch import load_file
    from ds_twocircuit.grpo.loss import LossCoefs
    from ds_twocircuit.grpo.rollouts import Rollout
    p = subprocess.run(ds_cmd(8, "tests/dist_objective.py", tiny_model, ROOT / "tests/configs/tiny.json", tmp_path),
                       cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    saved = torch.load(tmp_path / "rollout.pt")
    r = Rollout(**saved["rollout"])
    coefs = LossCoefs(kl_coef=obj.BETA)
    ref, sums = obj.reference_gradients(str(tiny_model), r, saved["old"], saved["ref"], coefs)
    # the batch exercises every branch of the loss: both clips, the dual clip, the KL term
    assert sums["actor/pg_clipfrac_below"] > 0.05 and sums["actor/pg_clipfrac"] > sums["actor/pg_clipfrac_below"]
    assert sums["actor/pg_clipfrac_lower"] > 0 and sums["actor/kl_loss"] > 0     # verl's name: the dual clip
    norm = torch.sqrt(sum(g.double().pow(2).sum() for g in ref.values())).item()
    assert norm > 3 * obj.MAX_NORM, norm
    clip = json.loads((tmp_path / "clip.json").read_text())
    assert math.isclose(clip["pre_clip_norm"], norm, rel_tol=1e-5), (clip, norm)
    from ds_twocircuit.grpo.rollout_correction import Correction, correction_sums
    corr = Correction(**obj.CORRECTION)
    ref_corr, _ = obj.reference_gradients(str(tiny_model), r, saved["old"], saved["ref"],
                                          dataclasses.replace(coefs, correction=corr))
    cs = correction_sums(saved["old"], r.sampler_logp_NT1, r.resp_NT1 / r.resp_NT1.sum(), corr)
    # the correction truncates, rejects, and moves the gradient far beyond the bounds below
    assert cs["rollout_corr/rollout_is_ratio_fraction_high"] > 0.02 and cs["rollout_corr/rollout_rs_masked_fraction"] > 0.02
    moved = sum((ref_corr[n] - ref[n]).pow(2).sum() for n in ref) ** 0.5 / norm
    assert moved > 0.05, moved
    for kind, scale, want in (("plain", 1.0, ref), ("trimmed", 1.0, ref), ("clipped", obj.MAX_NORM / (norm + 1e-6), ref),
                              ("corrected", 1.0, ref_corr)):
        got = {}
        for f in sorted((tmp_path / kind).glob("grads_stage*.safetensors")):
            for n, g in load_file(f).items():
                if n in got:                      # the tied head's copy: the same reduced gradient
                    assert torch.equal(got[n], g), n
                got[n] = g
        assert got.keys() == want.keys()
        for n in want:
            # trimmed passes sum in other shapes: 1e-5 of a tensor's largest element on AVX-512 CPUs,
            # up to 2.3e-5 on an AVX2 Zen 3 (a key bias, whose true gradient is 0, all cancellation)
            atol = (1e-7 if kind == "plain" else 5e-5 * float(want[n].abs().max())) * scale
            torch.testing.assert_close(got[n], want[n] * scale, rtol=1e-5, atol=atol,
                                       msg=lambda m, kind=kind, n=n: f"{kind} {n}: {m}")
    before, after = torch.zeros_like(r.resp_NT1), torch.zeros_like(r.resp_NT1)
    for f in tmp_path.glob("direction*.pt"):
        d = torch.load(f)
        before[slice(*d["rows"])], after[slice(*d["rows"])] = d["before"], d["after"]
    delta = ((after - before) * r.resp_NT1).sum(1) / r.resp_NT1.sum(1)          # mean Δlog π per response
    assert float((r.adv_N * delta).sum()) > 0
    assert float(delta[r.adv_N > 0].mean()) > float(delta[r.adv_N < 0].mean()), delta
