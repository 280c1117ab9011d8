"""The sampler's weight sync and θ to the anchor as lossless deltas (sync/weight_sync.py, sync/delta.py) on a
real launch: the `anchored` reference run (8 ranks, bf16 HF sampler, the anchor at c = K = 2)."""
import pytest
import torch
from conftest import rows, stage_numel, weights
from safetensors.torch import load_file

from ds_twocircuit.anchor.mailbox import steps_in

pytestmark = pytest.mark.dist


def test_the_sampler_holds_the_trainer_weights_rounded_bitwise(anchored):
    """After 12 steps of delta syncs the HF sampler's own parameters, the mirror rank 0 rebuilt from
    the stages' deltas and the trainer's exported fp32 weights rounded to bf16 are bitwise equal.
    The wire carried fewer bytes than whole bf16 tensors every step, `sync/dense_bytes` is exactly
    those tensors (stages 1–7: rank 0's own stage crosses no wire), and θ went to the anchor whole
    once, then as deltas smaller than that keyframe. (At this config's lr, 3e-4, about 90 % of the
    bf16 values change per step, so most tensors go as bitmaps; notebooks/delta_fraction.py and the
    README measure realistic rates.)"""
    held = load_file(str(anchored / "sampler" / "held.safetensors"))
    mirror = load_file(str(anchored / "sampler" / "mirror.safetensors"))
    trained = weights(anchored)
    assert held.keys() == mirror.keys() and mirror.keys() <= trained.keys()
    for n in mirror:
        assert mirror[n].dtype == torch.bfloat16
        assert torch.equal(held[n].view(torch.int16), mirror[n].view(torch.int16)), n
        assert torch.equal(trained[n].to(torch.bfloat16).view(torch.int16), mirror[n].view(torch.int16)), n
    r = rows(anchored)
    dense = 2 * sum(stage_numel(anchored)[1:])
    assert all(x["sync/dense_bytes"] == dense for x in r)
    assert all(0 < x["sync/changed_frac"] < 1 and x["sync/bytes"] < dense for x in r), \
        [(x["sync/changed_frac"], x["sync/bytes"] / dense) for x in r]
    ups = [x["anchor/bytes_up"] for x in r if x["anchor/bytes_up"] > 0]   # ships at t = 0, 2, ..., 8
    assert len(ups) == 5 and all(u < ups[0] for u in ups[1:]), ups
    mailbox = anchored / "anchor"
    assert list((mailbox / "theta").rglob("*.delta.safetensors")) and steps_in(mailbox / "theta")


def test_a_bf16_sampler_beside_an_fp32_trainer_shows_its_gap(anchored, eight):
    """The same `anchored` run: at its codec-off probes (steps 1, 5, 9) the fp32 pipeline's dense
    log-probs of the sampled tokens differ from the bf16 sampler's by bf16's rounding, orders of
    magnitude above the fp32 sampler's float noise (the `eight` run, fp32 on both sides), and the
    gap is reported, not hidden by the codec's own (the probe is codec-off)."""
    probes = [x for x in rows(anchored) if "probe/rollout_corr/logp_diff_mean" in x]
    assert [x["step"] for x in probes] == [1, 5, 9]
    bf16 = [x["probe/rollout_corr/logp_diff_mean"] for x in probes]
    fp32 = [x["rollout_corr/logp_diff_mean"] for x in rows(eight)]
    print("mean |Δ log p| per token, bf16 sampler:", bf16, "fp32 sampler:", fp32)
    assert max(fp32) < 1e-5 and min(bf16) > 100 * max(fp32) and max(bf16) < 0.5, (bf16, fp32)
