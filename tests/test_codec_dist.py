"""The compressed pipeline on real DeepSpeed processes.

- its gradients equal single-process autograd of the same compressed model (PRF on all 7 cuts);
- keep-all (k = d) PRF trains bitwise like the dense pipeline;
- PRF at 25 %: the reference and the policy see the same masks (KL exactly 0 at step 1), the wire
  carries k/d of the dense bytes per direction, counted at DeepSpeed's p2p layer;
- the same launch carries the diagnostics (every logged key of docs/metrics.md, probe keys on probe steps) and the drift
  controller (β update, a dense step).
(The lowrank codec runs end to end in tests/test_anchor_dist.py's fault test. A resumed PRF run with
the controller on continues bit for bit: tests/test_faults.py's crash chain, four resumes.)
"""
import json
import math
import os
import subprocess

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, VOLATILE, assert_resumed_rows, assert_rows_close, assert_same_weights, ds_cmd, launch, rows, weights
from dist_grads import reference_grads
from ds_twocircuit.control import next_level

pytestmark = pytest.mark.dist
SPLIT = [1] * 8


# the launch's codec specs (dist_grads.py's grammar): "t" trims (the second micro-batch narrower, shapes
# sent with each), "s" shares each group's prompt, "c1.3.5:" compresses only the cuts after layers 1,
# 3 and 5, so stages 1, 3 and 5 receive dense fp32 and send the rotated codec's fp16 carrier and stages
# 2, 4 and 6 the reverse (the receive buffers' dtype, pipeline/recv_buffers.py)
SPECS = ("3", "32", "r32x4/20x2", "r20x2/20x2", "r32x3t8/20x2t8", "r32x2t8g/20x2", "r32x4/q3", "r32x2t8g/q2", "3s",
         "r32x4/20x2s", "3t", "3ts", "r32x4/20x2t", "r32x4/20x2ts", "c1.3.5:r32x4/20x2", "c1.3.5:r32x4/20x2t",
         "c1.3.5:3ts")


@pytest.fixture(scope="module")
def cut_launch(tiny_model, tmp_path_factory):
    """One launch of tests/dist_grads.py over SPECS, with the wire's strict check on (conftest); → (its
    output folder, its log). A launch that fails fails each test that reads it (`launched`)."""
    out = tmp_path_factory.mktemp("cuts")
    p = subprocess.run(ds_cmd(8, "tests/dist_grads.py", tiny_model, json.dumps(SPLIT), ",".join(SPECS), out),
                       cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300)
    return out, p.returncode, p.stdout + p.stderr


def launched(cut_launch):
    out, rc, text = cut_launch
    assert rc == 0, text[-3000:]
    return out, text


def test_compressed_pipeline_gradients_equal_single_process_autograd(tiny_model, cut_launch):
    """PRF k = 3 and k = 32 (keep-all), and the rotated codec with a payload beside its carrier
    (18 B forward, 8 B back), with the carrier alone (8 B both ways) and with a scale per tile of 8
    (protocol v2: 18 B forward, 10 B back), with Gaussian levels forward, and with the backward's
    rank-3 code of each micro-batch, in one launch, one train_batch each: each stage's gradients
    equal plain autograd through the same layers and codec in one process (the rotated codec's
    quantized gradient crosses each cut inside the carrier). The rank code is pinned on its own: a
    truncated SVD is ill-conditioned where two singular values nearly meet, so float-order
    differences of 1e-7 in a cut's gradient can move its bf16 factors by an ulp (Gaussian levels
    with rank 3 on this data: 0.8 % of the largest embedding gradient, measured). frontier_wide.json's
    pair, Gaussian levels with rank 2 (r32x2t8g/q2), agrees to 1e-7 here and is pinned too. With each
    group's prompt shared ("3s", "r32x4/20x2s": the prompt crosses once per group, its gradient
    summed over the group; what that equals unshared is test_codec.py's) the pipeline's transport of
    the shared tuples gives the same gradients as the single process; so do trimmed micro-batches
    and stages whose two cuts differ in wire dtype ("c1.3.5:..."). The reference shares the `Decoder`
    modules with the pipeline: that each cut decodes what was sent is the next test's."""
    tmp_path, text = launched(cut_launch)
    # the tied embedding's broadcasts (TwoCircuitPipe._synchronize_tied_weights) leave autograd alone:
    # the backward prints no "silently incorrect behavior" warning about c10d::broadcast_
    assert "silently incorrect" not in text and "autograd kernel was not registered" not in text, text[-3000:]
    for k in SPECS:
        got = {}
        for f in (tmp_path / f"k{k.replace('/', '_')}").glob("grads_stage*.safetensors"):
            got.update(load_file(f))
        ref = reference_grads(tiny_model, SPLIT, k)
        assert got.keys() == ref.keys()
        for n in ref:   # float order: DeepSpeed accumulates the micro-batches' backwards, the reference
            # runs one; measured ≤ 7e-7 of a tensor's largest element (PRF k = 3 with shared prompts)
            atol = max(1e-6, 2e-6 * float(ref[n].abs().max()))
            torch.testing.assert_close(got[n], ref[n], rtol=1e-5, atol=atol, msg=f"k={k} {n}")


# ---- each cut against the codec's pure functions, keyed explicitly ------------------------------
def token_positions(attn_BT):
    """A token's position: real tokens counted from 0, pads before them at 0 (HF generate's rule for
    left-padded prompts), written here apart from model/pipe.py's."""
    return (attn_BT.cumsum(-1) - 1).clamp(min=0)


def source_rows(B: int, T: int, P: int, G: int):
    """(B, T): the row whose value of each token crossed the cut: its own, or with a shared prompt the
    group's first row for the first P columns."""
    src = torch.arange(B)[:, None].repeat(1, T)
    if P:
        src[:, :P] = (torch.arange(B) // G * G)[:, None]
    return src


def cut_maps(spec: str, d: int, layer: int):
    """(forward, backward) of one cut as functions of (x_ND, keys_N) → what the other end holds."""
    from ds_twocircuit.codec import prf, rotated
    from dist_grads import make_codec
    c = make_codec(d, spec, SPLIT)
    if layer not in c.cuts:
        return (lambda x, _: x), (lambda g, _: g)
    if c.name == "prf":
        def keep(x, keys):
            K = prf.kept_channels(keys, d, c.k)
            return torch.zeros_like(x).scatter(-1, K, x.gather(-1, K) * (d / c.k))
        return keep, keep
    code = lambda b, direction: (lambda x, keys: rotated.decode(rotated.encode(x, keys, b, direction), keys, b,
                                                                direction))
    return code(c.fwd, "fwd"), code(c.bwd, "bwd")


@pytest.mark.parametrize("spec", [s for s in SPECS if "/q" not in s and s != "32"])
def test_every_cut_decodes_what_was_sent(tiny_model, cut_launch, spec):
    """What each stage of the launch received, forward and backward, at every cut, against the codec's
    pure functions (prf.token_keys, prf.kept_channels, rotated.encode/decode) called with explicit
    (seed, layer, step, sample, position), positions from the micro-batch's mask: forward, the
    receiver's decoded x̂ is the map of the sender's x, token by token, keyed by the token it came
    from; backward, the sender's ∂x is the map of the receiver's ∂x̂ (a shared prompt's summed over its
    group, 0 on the prompt rows that did not cross). Nothing of the `Decoder` modules or of
    `Codec`'s keying runs on the reference side, so a receiver keyed at another position, layer or
    step than its sender fails here. (The rank code of the backward is a micro-batch's, not a
    token's: its cut is the previous test's; keep-all PRF cannot see keys.)"""
    from ds_twocircuit.codec import prf
    from ds_twocircuit.model.pipe import load_hf_config
    from dist_grads import SEED, STEP, micro_batches, parse
    out, _ = launched(cut_launch)
    rec = {}
    for f in (out / f"k{spec.replace('/', '_')}").glob("cuts_stage*.pt"):
        rec.update(torch.load(f))
    _, _, trimmed, shared = parse(spec)
    d, vocab = rec["x/0/0"].shape[-1], load_hf_config(tiny_model, "sdpa").vocab_size
    checked = 0
    for layer in range(len(SPLIT) - 1):
        fwd, bwd = cut_maps(spec, d, layer)
        for m, ((ids, attn, sid, *share), _) in enumerate(micro_batches(vocab, shared, trimmed)):
            B, T = attn.shape
            P, G = (int(share[0][0]), int(share[0][1])) if share else (0, 0)
            src = source_rows(B, T, P, G)
            keys = prf.token_keys(SEED, layer, STEP, sid[src], token_positions(attn).gather(0, src))   # (B, T)
            x, xhat = rec[f"x/{layer}/{m}"], rec[f"xhat/{layer}/{m}"]
            want = fwd(x.gather(0, src[..., None].expand(B, T, d)).reshape(-1, d), keys.reshape(-1)).view(B, T, d)
            torch.testing.assert_close(xhat, want, rtol=0, atol=0, msg=f"{spec} cut {layer} mb {m}: forward")
            ghat = rec[f"gxhat/{layer}/{m}"]
            summed = torch.zeros_like(ghat).index_put_((src, torch.arange(T).expand(B, T)), ghat, accumulate=True)
            crossed = torch.zeros(B, T, 1).index_put_((src, torch.arange(T).expand(B, T)), torch.ones(B, T, 1))
            want = bwd(summed.reshape(-1, d), keys.reshape(-1)).view(B, T, d) * crossed
            # the reference's keys are the source token's, which a row that did not cross lacks: masked
            torch.testing.assert_close(rec[f"gx/{layer}/{m}"], want, rtol=0, atol=0,
                                       msg=f"{spec} cut {layer} mb {m}: backward")
            checked += 1
    assert checked == (len(SPLIT) - 1) * 2


def test_keep_all_prf_is_bitwise_dense(eight, tmp_path):
    launch(8, tmp_path, "codec.name=prf", "codec.keep=32")
    same = lambda r: {k: v for k, v in r.items() if not k.startswith((*VOLATILE, "codec/"))}
    for ra, rb in zip(rows(eight), rows(tmp_path)):
        assert same(ra) == same(rb), ra["step"]
    wa, wb = [load_file(f) for f in sorted((eight / "model").glob("*.safetensors"))], \
             [load_file(f) for f in sorted((tmp_path / "model").glob("*.safetensors"))]
    assert all(torch.equal(a[n], b[n]) for a, b in zip(wa, wb) for n in a)


LOGGED_KEYS = ["critic/score/mean", "response_length/mean", "actor/pg_loss", "actor/pg_clipfrac", "actor/pg_clipfrac_lower",
      "actor/pg_clipfrac_below", "actor/ppo_kl", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "actor/grad_norm_clipped", "actor/kl_coef",
      "timing/gen", "timing/train", "timing/sync", "rollout_corr/kl", "rollout_corr/k3_kl",
      "rollout_corr/prob_diff_mean", "rollout_corr/pearson", "wire/total_bytes", "wire/busiest_link_bytes",
      "wire/baseline_bytes"] + \
     [f"weights/{m}/stage{s}" for m in ("rel_change", "cos_base") for s in range(8)]
PROBE = ["probe/rollout_corr/kl", "probe/rollout_corr/k3_kl", "probe/rollout_corr/prob_diff_mean",
         "probe/rollout_corr/pearson", "probe/actor/kl_loss", "probe/actor/entropy", "grad/cos_comp_dense",
         "grad/cos_corrected_dense"]


# trimmed micro-batches, as the dense control's rule chooses for the tiny batches (the byte-for-byte
# comparisons with it below need one layout; its codec alone would keep them padded)
PRF_CONTROLLED = ("codec.name=prf", "codec.keep_ratio=0.25", "train.probe_every=2", "control.enabled=true",
                  "control.dense_rate_min=0.4", "control.dense_rate_max=0.4", "train.trim_micro_batches=always")


@pytest.fixture(scope="module")
def prf(tiny_model, tmp_path_factory):
    """PRF at 25 %, 4 steps, probes at steps 1 and 3, the drift controller on with the dense-step
    rate pinned at 0.4 (the accumulator reaches 1 at step 3: a dense step)."""
    d = tmp_path_factory.mktemp("prf")
    launch(8, d, *PRF_CONTROLLED)
    return d


def test_prf_wire_ratio_and_same_masks_across_passes(eight, prf):
    """Also: every logged key of docs/metrics.md on every step, the probe's on probe steps only, the dense step's gap and
    bytes, and the drift controller's β update from the two probe readings, used from step 4."""
    r = rows(prf)
    assert [x["step"] for x in r] == [1, 2, 3, 4]
    assert [x["train/dense_step"] for x in r] == [0.0, 0.0, 1.0, 0.0]
    for x in r:
        assert set(LOGGED_KEYS) <= x.keys(), set(LOGGED_KEYS) - x.keys()
        assert (set(PROBE) <= x.keys()) == (x["step"] in (1, 3)) and (PROBE[0] in x) == (x["step"] in (1, 3))
    assert all("rollout_corr/kl_slope" in x for x in r[1:])
    # the ledger files the dense step's p2p under its own kind; the dense fp32 pipeline's baseline is
    # its boundaries and tied gradients at half (bf16), the stream and the rollout as they are
    assert [x["wire/boundary_dense_bytes"] > 0 for x in r] == [False, False, True, False]
    assert [x["wire/boundary_update_bytes"] > 0 for x in r] == [True, True, False, True]
    for x in rows(eight):
        half = x["wire/boundary_update_bytes"] + x["wire/boundary_reference_bytes"] + x["wire/tied_grads_bytes"]
        assert x["wire/baseline_bytes"] == half / 2 + x["wire/stream_bytes"] + x["wire/rollout_bytes"]
    # the codec's gap is large from step 1; the dense pipeline's, the dense step's and the probe's are float noise
    assert all(abs(x["rollout_corr/kl"]) < 1e-5 for x in rows(eight))
    assert all(x["rollout_corr/kl"] > 1e-2 for x in (r[0], r[1], r[3])) and abs(r[2]["rollout_corr/kl"]) < 1e-5
    assert all(abs(x["probe/rollout_corr/kl"]) < 1e-5 for x in (r[0], r[2]))
    assert r[0]["probe/actor/kl_loss"] == 0.0 and r[2]["probe/actor/kl_loss"] > 0.0   # θ_0 is the reference
    # the controller: slope of the two probe readings per step, β moved by the law, used from step 4
    slope = (r[2]["probe/actor/kl_loss"] - r[0]["probe/actor/kl_loss"]) / 2
    assert r[2]["control/drift_slope"] == pytest.approx(slope)
    assert r[2]["control/kl_coef_next"] == pytest.approx(next_level(0.01, slope, 0.002, 1.0, 1e-4, 1.0))
    assert [x["actor/kl_coef"] for x in r[:3]] == [0.01] * 3 and r[3]["actor/kl_coef"] == r[2]["control/kl_coef_next"]
    assert [x["control/dense_rate"] for x in r] == [0.4] * 4
    assert r[0]["actor/kl_loss"] == 0.0            # reference and policy through the same masks
    k, d = 8, 32
    for x in (r[0], r[1], r[3]):
        assert x["codec/bytes_bwd"] == x["codec/dense_equiv_bytes_bwd"] * k / d    # gradients: payload only
        per_cut = [x[f"codec/boundary{b}/bytes_bwd"] for b in range(7)]
        assert sum(per_cut) == x["codec/bytes_bwd"] and len(set(per_cut)) == 1     # every cut, exactly k/d
        assert sum(x[f"codec/boundary{b}/bytes_fwd"] for b in range(7)) == x["codec/bytes_fwd"]
    assert r[2]["codec/bytes_bwd"] == r[2]["codec/dense_equiv_bytes_bwd"]        # the dense step sent everything
    # forward, exactly: step 1 samples the same batch in both runs; of what crossed, the floats (what
    # bf16 would halve) are the dense run's hidden states × k/d, and everything else (spans, sample
    # ids, DeepSpeed's shape messages) is byte for byte the dense run's: no index crosses
    floats = lambda x: 2 * (x["codec/bytes_fwd"] - x["codec/bytes_fwd_bf16"])
    assert floats(r[0]) == floats(rows(eight)[0]) * k / d
    assert r[0]["codec/bytes_fwd"] - floats(r[0]) == rows(eight)[0]["codec/bytes_fwd"] - floats(rows(eight)[0])
    # the dense-equivalent counterfactual is what the dense control really sent for the same batch,
    # laid out the same: trimmed (the dense control's rule chose it, the codec's run is pinned to it)
    dense = rows(eight)[0]
    assert dense["pipeline/trimmed_passes"] == r[0]["pipeline/trimmed_passes"] == 1     # its one update pass
    assert dense["pipeline/token_slots"] == r[0]["pipeline/token_slots"] < dense["pipeline/padded_slots"]
    assert dense["codec/bytes_fwd"] == dense["codec/dense_equiv_bytes"] == r[0]["codec/dense_equiv_bytes"]
    assert dense["codec/bytes_bwd"] == r[0]["codec/dense_equiv_bytes_bwd"]
    # in bf16 the fp32 tensors halve: every gradient sent back, the PRF payload, the dense activations
    # (the rest of the forward, integer ids and metadata, stays as sent)
    for x in (dense, r[0]):
        assert x["codec/bytes_bwd_bf16"] == x["codec/bytes_bwd"] / 2
    # (DeepSpeed's 1 KB shape message with every trimmed micro-batch is most of the rest on this toy model)
    assert dense["codec/bytes_fwd"] / 2 < dense["codec/bytes_fwd_bf16"] < dense["codec/bytes_fwd"] * 0.6


ROTATED = ("codec.name=rotated", "codec.fwd_bits=4", "codec.bwd_coords=20", "codec.bwd_bits=2")


def micro2_config(tmp_path):
    """The tiny test config with micro-batches of 2 sequences instead of 8 (a path)."""
    cfg = json.loads((ROOT / "tests/configs/tiny.json").read_text())
    cfg["train_micro_batch_size_per_gpu"] = 2
    (tmp_path / "micro2.json").write_text(json.dumps(cfg))
    return tmp_path / "micro2.json"


@pytest.fixture(scope="module")
def rotated(tiny_model, tmp_path_factory):
    """The rotated codec, forward 32 coordinates at 4 bits, backward 20 at 2 bits, 4 steps."""
    d = tmp_path_factory.mktemp("rotated")
    launch(8, d, *ROTATED)
    return d


def test_rotated_codec_bytes_per_direction_and_same_code_across_passes(rotated, tmp_path):
    """Forward 32 coordinates at 4 bits (18 B per token), backward 20 at 2 bits (8 B): the p2p layer
    sees exactly 8/128 of the dense gradient bytes back on every cut, the forward 18/128 plus the
    row descriptor; the reference and the policy pass see the same code (KL 0 at step 1); 16
    micro-batches instead of 4 give the same losses, codec-view KL and weights (the code is a token's
    own; 1e-4 relative, measured ≤ 1.6e-6 on the codec-view KL)."""
    r = rows(rotated)
    assert r[0]["actor/kl_loss"] == 0.0 and r[0]["rollout_corr/kl"] > 1e-4
    for x in r:
        assert x["codec/bytes_bwd"] == x["codec/dense_equiv_bytes_bwd"] * 8 / 128
        per_cut = [x[f"codec/boundary{b}/bytes_bwd"] for b in range(7)]
        assert sum(per_cut) == x["codec/bytes_bwd"] and len(set(per_cut)) == 1
        assert 18 / 128 < x["codec/bytes_fwd"] / x["codec/dense_equiv_bytes"] < 18 / 128 * 1.1
        # b-bit codes and integers: a bf16 pipeline sends the same bytes
        assert (x["codec/bytes_fwd_bf16"], x["codec/bytes_bwd_bf16"]) == (x["codec/bytes_fwd"], x["codec/bytes_bwd"])
    # 26 bytes a token slot on a cut: a trim would not pay for DeepSpeed's shape messages on these
    # short batches, so every pass stays padded (the dense control's trims, test_prf_wire_ratio_...)
    assert all(x["pipeline/trimmed_passes"] == 0 for x in r)
    launch(8, tmp_path / "micro2", *ROTATED, config=micro2_config(tmp_path))
    assert_rows_close(r, rows(tmp_path / "micro2"), ("actor/pg_loss", "actor/grad_norm", "rollout_corr/kl", "actor/entropy"),
                      rel_tol=1e-4)
    assert_same_weights(weights(rotated), weights(tmp_path / "micro2"))


def test_rotated_codec_resumes_bitwise(rotated, tmp_path):
    """Two steps, then `--resume` to four: the resumed steps' rows, the held-out evaluations and
    the weights equal the uninterrupted run's bit for bit (the dither's keys and the rotation come
    back from the step, not from state that a restart loses)."""
    launch(8, tmp_path, *ROTATED, "train.steps=2")
    launch(8, tmp_path, *ROTATED, "train.steps=4", resume=True)
    assert_resumed_rows(rows(rotated), rows(tmp_path), restarts={3})
    assert rows(rotated, "eval.jsonl") == rows(tmp_path, "eval.jsonl")
    wa, wb = weights(rotated), weights(tmp_path)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[n], wb[n]) for n in wa)


# ds_configs/frontier_wide.json's codec at the test model's width (d = 32: a scale per 8 coordinates)
FRONTIER = ("codec.name=rotated", "codec.fwd_bits=2", "codec.fwd_tile=8", "codec.fwd_levels=gauss",
            "codec.bwd_rank=2", "grpo.kl_coef=0")


def test_frontier_codec_resumes_bitwise(tmp_path):
    """The width's recipe (Gaussian levels forward, the rank-2 code of each micro-batch's gradient
    back, β = 0): four steps, and two then `--resume` to four, give the same rows, evaluations and
    weights bit for bit (the rank code's random test matrix is seeded by its micro-batch's first
    token key, so a restart draws it again). Its codes weigh the same in a bf16 pipeline, and the
    backward (2 · (n + d) bf16 values per micro-batch of n tokens) is a few bytes per token. Micro-
    batches of 2 sequences instead of 8 give the same step-1 forward (the forward code is each
    token's own); the update then differs, as the rank code is a micro-batch's (its stated bias)."""
    launch(8, tmp_path / "a", *FRONTIER)
    launch(8, tmp_path / "b", *FRONTIER, "train.steps=2")
    launch(8, tmp_path / "b", *FRONTIER, "train.steps=4", resume=True)
    ra = rows(tmp_path / "a")
    assert_resumed_rows(ra, rows(tmp_path / "b"), restarts={3})
    assert rows(tmp_path / "a", "eval.jsonl") == rows(tmp_path / "b", "eval.jsonl")
    wa, wb = weights(tmp_path / "a"), weights(tmp_path / "b")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[n], wb[n]) for n in wa)
    for x in ra:
        assert (x["codec/bytes_fwd_bf16"], x["codec/bytes_bwd_bf16"]) == (x["codec/bytes_fwd"], x["codec/bytes_bwd"])
        assert x["codec/bytes_bwd"] < x["codec/dense_equiv_bytes_bwd"] / 8
    launch(8, tmp_path / "micro2", *FRONTIER, "train.steps=1", config=micro2_config(tmp_path))
    r2 = rows(tmp_path / "micro2")[0]
    for k in ("actor/pg_loss", "rollout_corr/kl", "actor/entropy"):
        assert math.isclose(ra[0][k], r2[k], rel_tol=1e-4, abs_tol=1e-7), (k, ra[0][k], r2[k])


@pytest.mark.parametrize("codec", ["prf", "rotated"])
def test_activation_checkpointing_recomputes_the_same_codes(request, tiny_model, codec, tmp_path):
    """DeepSpeed's activation checkpointing on every decoder layer (PRF: pipeline.activation_checkpoint_interval
    with DeepSpeed's reentrant checkpoint; rotated: an activation_checkpointing section alone, with
    use_reentrant false): each recompute encodes the cut's tensor with the same keys, so every row
    (losses, cosines of the probe, the wire and payload counts, which a recompute must not count
    again), every evaluation and every weight equal the fixture run's without checkpointing, bit for
    bit. DeepSpeed's checkpoint profiler (`profile`, reentrant only) counts the recomputes: one per
    micro-batch of every pass with a backward on stage 0 (rank 0 prints), (4 updates + 2 probe
    gradients) × 8 micro-batches = 48: a silently disabled checkpoint, which also gives the bitwise
    equal run, prints none.
    (The rotated run also has DeepSpeed's csv_monitor on: it receives every step's metrics as logged.)"""
    cfg = json.loads((ROOT / "tests/configs/tiny.json").read_text())
    if codec == "prf":
        cfg.update(pipeline={"activation_checkpoint_interval": 1}, activation_checkpointing={"profile": True})
        overrides = PRF_CONTROLLED
    else:
        cfg.update(pipeline={"use_reentrant": False}, activation_checkpointing={},
                   csv_monitor={"enabled": True, "output_path": str(tmp_path), "job_name": "csv"})
        overrides = ROTATED
    (tmp_path / "ckpt.json").write_text(json.dumps(cfg))
    ref = request.getfixturevalue(codec)
    p = launch(8, tmp_path / "run", *overrides, config=tmp_path / "ckpt.json")
    assert "stage 0 recomputes 1 of 2 layer runs" in p.stdout, p.stdout[-2000:]
    if codec == "prf":
        recomputes = [l for l in (p.stdout + p.stderr).splitlines() if l.startswith("[Rank 0] time (ms) | backward")]
        assert len(recomputes) == (4 + 2) * 8, len(recomputes)
    keep = lambda r: {k: v for k, v in r.items() if not k.startswith(VOLATILE)}
    for ra, rb in zip(rows(ref), rows(tmp_path / "run"), strict=True):
        assert keep(ra) == keep(rb), (ra["step"], {k: (ra[k], rb.get(k)) for k in keep(ra) if ra[k] != rb.get(k)})
    assert rows(ref, "eval.jsonl") == rows(tmp_path / "run", "eval.jsonl")
    wa, wb = weights(ref), weights(tmp_path / "run")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[n], wb[n]) for n in wa)
    if codec == "rotated":
        csv = (tmp_path / "csv" / "critic_score_mean.csv").read_text().split()
        assert [float(l.split(",")[1]) for l in csv[1:]] == [r["critic/score/mean"] for r in rows(tmp_path / "run")]
