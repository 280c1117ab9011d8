"""Generation ahead of training (rollout.staleness = k), on real DeepSpeed processes.

The sampler runs in its own process and step j's batch is generated from θ_max(0, j−k) while the
pipeline trains the steps before it (`rollout/staleness` is what the sampler's process reported); the batches asked for and not yet trained on travel in the
checkpoint, so a run killed with batches in flight and resumed continues the uninterrupted one
bit for bit.
"""
import math

import pytest
import torch

from conftest import assert_resumed_rows, launch, rows, weights

pytestmark = pytest.mark.dist

# k = 1 with the rollout correction, six steps, a checkpoint every two, a probe every two
AHEAD = ("rollout.staleness=1", "grpo.rollout_correction.enabled=true", "train.steps=6", "train.save_every=2",
         "train.eval_every=3", "train.probe_every=2")


@pytest.fixture(scope="module")
def ahead(tiny_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("ahead")
    launch(8, d, *AHEAD)
    return d


def test_the_sampler_runs_a_step_ahead(ahead, eight):
    """Step 1 trains on batch 0 from θ_0 either way: its batch (rewards, lengths) and the gap between
    its sampler and trainer log-probs equal the synchronous run's bit for bit (generation in the
    sampler's process computes what rank 0 computed; the update differs only by the correction's
    weights, 1 within the fp32 gap: grad norm within 1e-5 relative); from step 2 each batch comes
    from the weights one step older than the trainer's, so the sampler–trainer gap, the codec off
    (tiny.json), is the staleness's alone: ~0 at step 1, far above the dense fp32 gap (1e-5) after."""
    r, sync = rows(ahead), rows(eight)
    assert [x["rollout/staleness"] for x in r] == [0.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    for k in ("critic/score/mean", "response_length/mean", "rollout_corr/kl", "rollout_corr/logp_diff_mean"):
        assert r[0][k] == sync[0][k], k
    assert math.isclose(r[0]["actor/grad_norm"], sync[0]["actor/grad_norm"], rel_tol=1e-5)
    assert abs(r[0]["rollout_corr/kl"]) < 1e-5 and r[0]["rollout_corr/rollout_rs_masked_fraction"] == 0.0
    assert all(x["rollout_corr/logp_diff_mean"] > 1e-3 for x in r[1:]), [x["rollout_corr/logp_diff_mean"] for x in r]
    assert all(x["rollout_corr/rollout_is_eff_sample_size"] < 1 - 1e-6 for x in r[1:])


def test_the_gap_splits_into_staleness_numerics_and_codec(ahead):
    """On probe steps (1, 3, 5) the sampler rescored the batch at the trainer's weights: the three
    parts add up to the gap; at step 1 (drawn from θ_0, trained at θ_0) the staleness part is float
    summation order; after it the gap is the staleness's, the numerics' part (fp32 sampler against
    the fp32 pipeline) stays at the dense fp32 gap, and the codec's, off in tiny.json, at 0."""
    r = rows(ahead)
    probed = [x for x in r if "mismatch/staleness_kl" in x]
    assert [x["step"] for x in probed] == [1, 3, 5]
    for x in probed:
        parts = x["mismatch/staleness_kl"] + x["mismatch/numerics_kl"] + x["mismatch/codec_kl"]
        assert math.isclose(parts, x["rollout_corr/kl"], rel_tol=1e-4, abs_tol=1e-7), x
        assert x["mismatch/numerics_logp_diff"] < 1e-5 and x["mismatch/codec_logp_diff"] < 1e-5, x
    assert probed[0]["mismatch/staleness_logp_diff"] < 1e-5
    assert all(x["mismatch/staleness_logp_diff"] > 1e-3 for x in probed[1:]), probed


def test_a_run_killed_with_batches_in_flight_resumes_bit_for_bit(ahead, tmp_path):
    """Rank 0 killed as the checkpoint of step 4 starts: `latest` names step 2, whose checkpoint holds
    the batches of steps 2 and 3, generated from θ_1 and θ_2 before the kill. The resumed launch
    trains on them (step 2, a probe step, is rescored again at θ_2 at init): rows (wall clock aside),
    evaluations and weights equal the uninterrupted run's."""
    p = launch(8, tmp_path, *AHEAD, check=False, env={"DS_TWOCIRCUIT_KILL_AT": "save@4@0"})
    assert p.returncode != 0 and (tmp_path / "checkpoints" / "latest").read_text().strip() == "step2"
    state = torch.load(tmp_path / "checkpoints" / "step2" / "mp_rank_00_model_states.pt", weights_only=False)
    held = state["rollouts_ahead"]
    assert sorted(held["batches"]) == [2, 3] and held["made_from"] == {2: 1, 3: 2}
    launch(8, tmp_path, *AHEAD, resume=True)
    assert_resumed_rows(rows(ahead), rows(tmp_path), restarts={3})
    assert rows(ahead, "eval.jsonl") == rows(tmp_path, "eval.jsonl")
    wa, wb = weights(ahead), weights(tmp_path)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[n], wb[n]) for n in wa)
