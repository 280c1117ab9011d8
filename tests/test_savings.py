"""The exact savings: bytes that need not cross the pipeline's cuts, and the proofs that leaving them
out changes nothing it should not.

    skip_zero_advantage   the groups whose rewards are all equal stay out of the update passes: at
                          β = 0 the update is the same (with a codec on), fewer bytes cross
    ref_logprobs=sampler  the reference log-probs come from a dense model on the sampler's rank: they
                          equal the codec-off pipeline's, and the pipeline's reference pass is gone
"""
import math

import pytest
import torch

from conftest import assert_rows_close, assert_same_weights, launch, rows, weights

pytestmark = pytest.mark.dist


@pytest.mark.parametrize("codec", [("codec.name=prf",), ("codec.name=rotated", "codec.fwd_bits=4", "codec.bwd_bits=2")],
                         ids=["prf", "rotated"])
def test_skipped_zero_advantage_groups_leave_the_update_unchanged(tiny_model, tmp_path, codec):
    """β = 0, a codec on: the same losses, gradient norms and weights with the all-equal groups left
    out of the pipeline, and fewer bytes on the wire. Equal to float summation order only (the kept
    sequences sit in other micro-batches), and the tiny model's 5 % codecs amplify that: measured with
    PRF, the gradient norm differs by 2e-8 relative at step 1, 3e-6 at 2, 1e-5 at 3, 2e-4 at 4 on
    an AVX-512 CPU, and by 2.1e-5 at step 2 on an AVX2 Zen 3, so two steps are compared, the first
    within 1e-5, the second within 1e-4 (a group that wrongly fed the update moves it by percents)."""
    common = ("grpo.kl_coef=0", "train.steps=2", "train.eval_every=100", *codec)
    launch(8, tmp_path / "all", *common)
    launch(8, tmp_path / "skip", *common, "grpo.skip_zero_advantage=true")
    a, b = rows(tmp_path / "all"), rows(tmp_path / "skip")
    assert any(r["train/skipped_groups"] > 0 for r in b), "no group was skipped: the test proves nothing"
    assert_rows_close(a[:1], b[:1], ("actor/pg_loss", "actor/grad_norm", "critic/score/mean"), rel_tol=1e-5)
    assert_rows_close(a[1:], b[1:], ("actor/pg_loss", "actor/grad_norm", "critic/score/mean"), rel_tol=1e-4)
    for ra, rb in zip(a, b):
        assert rb["train/skipped_groups"] == ra["train/zero_advantage_groups"]
        # 16 groups of 4 in micro-batches of 8: the kept sequences, rounded up to micro-batches; each
        # pass also sends its shapes once per cut (the same in both runs)
        kept_micro = max(1, math.ceil(round(16 * (1 - rb["train/skipped_groups"])) * 4 / 8))
        for key in ("codec/bytes_fwd", "codec/bytes_bwd"):
            assert (rb[key] < ra[key]) if kept_micro < 8 else (rb[key] == ra[key]), (ra["step"], key, kept_micro)
    # Adam's first steps move every weight by about lr whatever its gradient's size, so float-order
    # noise on a gradient that is mostly cancellation moves weights apart; measured after 2 steps:
    # PRF 1.8e-6 (0.6 % of lr), rotated 1.2e-7. A group that wrongly fed the update moves them by ~lr.
    wa, wb = weights(tmp_path / "all"), weights(tmp_path / "skip")
    lr, steps = 3e-4, 2
    for n in wa:
        assert (wa[n] - wb[n]).abs().max() <= 0.01 * lr * steps, n


def test_sampler_reference_equals_the_codec_off_pipeline_reference(eight, tmp_path):
    """Dense codec, β = 0.01 (the tiny config's): the reference log-probs of rank 0's dense base model
    give the pipeline reference pass's KL and weights, and the forward bytes halve (one pass, not two).
    Bound 1e-4 relative for an HF model beside the pipeline; measured here: bitwise equal."""
    launch(8, tmp_path, "grpo.ref_logprobs=sampler")
    a, b = rows(eight), rows(tmp_path)
    assert_rows_close(a, b, ("actor/kl_loss", "actor/pg_loss", "actor/grad_norm", "probe/actor/kl_loss"), rel_tol=1e-4)
    for ra, rb in zip(a, b):
        # one forward pass instead of two of the same shapes; each run also sends its shapes once per
        # cut (~1 KB each) after a reset, so twice the one-pass bytes exceed the two-pass bytes by that
        assert 0 <= 2 * rb["codec/bytes_fwd"] - ra["codec/bytes_fwd"] <= 7 * 1024 + 1024, (ra["step"],)
        assert rb["codec/bytes_bwd"] == ra["codec/bytes_bwd"]
        assert "codec/bytes_ref_logprobs" not in ra
        assert rb["codec/bytes_ref_logprobs"] == 4 * round(rb["response_length/mean"] * 64)
    assert a[-1]["actor/kl_loss"] > 0
    assert_same_weights(weights(eight), weights(tmp_path))


def test_shared_prompts_equal_unshared_with_the_codec_off(eight, tmp_path):
    """Dense codec: each cut sends a group's prompt once and its gradient summed over the group, and
    the losses, gradient norms and weights are the unshared run's to float summation order (1e-5
    relative; measured ≤ 7.1e-7, the KL), while fewer bytes cross both ways."""
    launch(8, tmp_path, "grpo.share_prompts=true")
    a, b = rows(eight), rows(tmp_path)
    assert_rows_close(a, b, ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/entropy"), rel_tol=1e-5)
    for ra, rb in zip(a, b):
        assert rb["codec/bytes_fwd"] < 0.7 * ra["codec/bytes_fwd"] and rb["codec/bytes_bwd"] < 0.7 * ra["codec/bytes_bwd"]
    assert_same_weights(weights(eight), weights(tmp_path))


def test_shared_prompts_with_the_rotated_codec_and_two_mini_batches(tiny_model, tmp_path):
    """A shared prompt is one code per group, keyed by the group: the first update's train pass
    reproduces the old-policy pass exactly (ratio 1 to the bit) across two PPO mini-batches, and
    the bytes fall against the same run unshared."""
    common = ("codec.name=rotated", "grpo.ppo_mini_batches=2", "train.steps=2", "train.eval_every=100")
    launch(8, tmp_path / "all", *common)
    launch(8, tmp_path / "shared", *common, "grpo.share_prompts=true")
    for ra, rb in zip(rows(tmp_path / "all"), rows(tmp_path / "shared")):
        assert rb["actor/first_update_abs_log_ratio"] == 0.0
        assert math.isfinite(rb["actor/grad_norm"]) and rb["actor/ppo_kl"] != 0.0
        assert rb["codec/bytes_fwd"] < 0.7 * ra["codec/bytes_fwd"] and rb["codec/bytes_bwd"] < 0.7 * ra["codec/bytes_bwd"]


def test_shared_prompts_reach_the_anchor_replay(tiny_model, tmp_path):
    """The anchor's own pipeline replays each batch with the prompts shared too: at c = 1, K = 0,
    β_M = 0 its sign(M) is the sign of the trainer's gradient of the same batch and weights, on every
    coordinate (dense codec, so nothing but the sharing could tell the two apart)."""
    launch(8, tmp_path, "grpo.share_prompts=true", "anchor.enabled=true", "anchor.every=1", "anchor.staleness=0",
           "anchor.beta_m=0", "train.probe_every=1", "train.steps=3", "train.eval_every=100")
    r = rows(tmp_path)
    assert [x["anchor/fire"] for x in r] == [0.0, 1.0, 2.0]
    assert [x["anchor/sign_agreement"] for x in r] == [1.0] * 3
