"""The embedded base model, the HF sampler, per-stage weight I/O."""
import json
import pathlib

import torch

from ds_twocircuit.model.pipe import explicit_parts, positions_from_mask
from ds_twocircuit.model.tiny import build_tokenizer, ensure_tiny_model
from ds_twocircuit.model.weights import SafetensorsReader
from ds_twocircuit.sampler.hf import HFSampler


def test_tokenizer_round_trip(tmp_path):
    tok = build_tokenizer()
    ids = tok.encode("07+3*9=34", add_special_tokens=False)
    assert len(ids) == 9 and tok.decode(ids) == "07+3*9=34" and len(tok) == 17
    tok.save_pretrained(tmp_path)
    from transformers import AutoTokenizer
    assert AutoTokenizer.from_pretrained(tmp_path).encode("07+3*9=34", add_special_tokens=False) == ids


def test_tiny_model_is_cached_and_warm(tiny_model, cache_dir):
    info = json.loads((cache_dir.glob("tiny-*/warmup.json").__next__()).read_text())
    # warm: 0.17 on its 64 held-out problems (measured 2026-12-06; ±0.05 binomial), 0.0 unwarmed
    assert info["num_layers"] == 8 and 0.1 <= info["held_out_acc"] <= 1.0, info
    assert info["cpu_capability"] == torch.backends.cpu.get_cpu_capability() and info["torch"] == torch.__version__
    weights = pathlib.Path(tiny_model) / "model.safetensors"
    assert weights.parent.parent == cache_dir
    mtime = weights.stat().st_mtime
    from ds_twocircuit.config import TinyModelConfig
    again = ensure_tiny_model(TinyModelConfig(hidden_size=32, num_layers=8, num_heads=1, num_kv_heads=1,
                                              warmup_steps=400, warmup_batch=64), 64)
    assert again == tiny_model and weights.stat().st_mtime == mtime


def test_sampler_logprobs_are_its_own(tiny_model):
    s = HFSampler(tiny_model)
    torch.manual_seed(0)
    g = s.generate(["12+3*4=", "5+1*1="], 3, max_new_tokens=4, temperature=0.7)
    assert g.ids_NT.shape[0] == 6 and g.resp_NT1.shape == g.logp_NT1.shape == (6, g.ids_NT.shape[1] - 1)
    with torch.no_grad():
        logits = s.model(input_ids=g.ids_NT, attention_mask=g.attn_NT, position_ids=positions_from_mask(g.attn_NT)).logits
    lp = torch.log_softmax(logits[:, :-1] / 0.7, -1).gather(-1, g.ids_NT[:, 1:, None])[..., 0]
    m = g.resp_NT1.bool()
    torch.testing.assert_close(lp[m], g.logp_NT1[m], atol=1e-5, rtol=1e-5)
    # the response ends at its first eos, inclusive; nothing after it is scored
    for row, ids in zip(g.resp_NT1, g.ids_NT):
        on = row.nonzero().flatten()
        assert (on == torch.arange(on[0], on[-1] + 1)).all()
        if ids[on[-1] + 1] == s.eos_id:
            assert on[-1] + 1 == len(row) or row[on[-1] + 1:].sum() == 0


def test_sampler_seed_and_bf16(tiny_model):
    """`seed` makes a draw repeatable; a bf16 sampler holds bf16 weights, takes fp32 ones rounded
    to bf16 in place, and samples with them, computing in fp32 on the CPU (values bf16 can take)."""
    s = HFSampler(tiny_model)
    a, b = (s.generate(["12+3*4="], 4, max_new_tokens=4, seed=7) for _ in range(2))
    assert torch.equal(a.ids_NT, b.ids_NT) and torch.equal(a.logp_NT1, b.logp_NT1)
    half = HFSampler(tiny_model, dtype="bfloat16")
    assert {dt for _, dt in half.weight_shapes().values()} == {torch.bfloat16}
    named = list(s.model.named_parameters())
    assert half.load_weights(dict(named)) == sum(p.numel() * 2 for _, p in named)
    assert all(torch.equal(q, p.to(torch.bfloat16).float()) for (_, p), q in zip(named, half.model.parameters()))
    assert {p.dtype for p in half.model.parameters()} == {torch.float32}
    assert all(torch.equal(h, p.to(torch.bfloat16)) for (_, p), h in zip(named, half.held_weights().values()))
    g = half.generate(["12+3*4="], 4, max_new_tokens=4, seed=7)
    assert (g.logp_NT1[g.resp_NT1.bool()] <= 0).all() and g.resp_NT1.sum() > 0


def test_the_cache_key_holds_the_held_out_split():
    """Two held-out sizes are two warm starts: neither ever trained on the other's held-out rows."""
    from ds_twocircuit.config import TinyModelConfig
    from ds_twocircuit.model.tiny import tiny_model_key
    assert tiny_model_key(TinyModelConfig(), 512) != tiny_model_key(TinyModelConfig(), 1000)
    assert tiny_model_key(TinyModelConfig(), 512) == tiny_model_key(TinyModelConfig(), 512)
    from ds_twocircuit.config import WideModelConfig
    assert tiny_model_key(WideModelConfig(), 512) != tiny_model_key(TinyModelConfig(), 512)


def test_reader_reads_only_what_is_asked(tiny_model):
    r = SafetensorsReader(tiny_model)
    got = r.read(["model.layers.3.mlp.up_proj.weight"])
    assert list(got) == ["model.layers.3.mlp.up_proj.weight"]


def test_explicit_parts_and_positions():
    assert explicit_parts([4, 4, 4, 4, 3, 3, 3, 3]) == [0, 5, 9, 13, 17, 20, 23, 26, 31]
    attn = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0]])
    assert positions_from_mask(attn).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 2, 2]]
