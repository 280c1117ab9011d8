"""What the samplers sample and where they stop, whatever the model's own generation_config.json says.

The GRPO ratio needs the log-prob of each sampled token under the distribution it was drawn from,
softmax(logits / τ); a model's saved sampling fields (repetition_penalty, min_p, ...) would change
the draws but not the logged numbers. Chat models name several EOS ids; a response ends at any one.
"""
import json
import shutil
from types import SimpleNamespace

import pytest
import torch

from ds_twocircuit.grpo.rollouts import Rollout, response_lengths
from ds_twocircuit.model.pipe import positions_from_mask
from ds_twocircuit.sampler.hf import HFSampler
from ds_twocircuit.sampler.vllm import VLLMSampler, _through_eos

PROMPTS = ["12+3*4=", "5+1*1=", "45-9="]
TAU = 0.7
# saved sampling fields, each of which HF `generate` would otherwise apply (a logits processor or warper)
LOUD = {"do_sample": True, "temperature": 3.0, "top_k": 2, "top_p": 0.5, "min_p": 0.5, "typical_p": 0.3,
        "repetition_penalty": 5.0, "no_repeat_ngram_size": 1, "epsilon_cutoff": 0.2, "eta_cutoff": 0.2,
        "min_new_tokens": 3, "suppress_tokens": [3], "bad_words_ids": [[4]], "sequence_bias": [[[5], -10.0]],
        "renormalize_logits": True}


def with_generation_config(src: str, dst, **fields) -> str:
    """A copy of the model at `src` whose generation_config.json also sets `fields`."""
    shutil.copytree(src, dst)
    path = dst / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))
    return str(dst)


def forward_logp(s: HFSampler, g, tau: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A plain forward of the generated rows: (log softmax(logits / τ) of each target, argmax) in target coords."""
    with torch.no_grad():
        logits = s.model(input_ids=g.ids_NT, attention_mask=g.attn_NT, position_ids=positions_from_mask(g.attn_NT)).logits
    lp = torch.log_softmax(logits[:, :-1] / tau, -1).gather(-1, g.ids_NT[:, 1:, None])[..., 0]
    return lp, logits[:, :-1].argmax(-1)


def responses(g, P: int) -> list[list[int]]:
    return [ids[P:][m[P - 1:].bool()].tolist() for ids, m in zip(g.ids_NT, g.resp_NT1)]


def test_saved_sampling_fields_change_nothing_sampled(tiny_model, tmp_path):
    """The same seed draws the same tokens from a model whose generation_config.json sets LOUD as
    from the plain model; every logged log-prob is log softmax(logits / τ) of a plain forward; greedy
    is the forward's argmax at every response token."""
    plain, loud = HFSampler(tiny_model), HFSampler(with_generation_config(tiny_model, tmp_path / "loud", **LOUD))
    a = plain.generate(PROMPTS, 4, max_new_tokens=8, temperature=TAU, seed=0)
    b = loud.generate(PROMPTS, 4, max_new_tokens=8, temperature=TAU, seed=0)
    assert torch.equal(a.ids_NT, b.ids_NT) and torch.equal(a.resp_NT1, b.resp_NT1)
    torch.testing.assert_close(a.logp_NT1, b.logp_NT1, atol=0, rtol=0)
    lp, _ = forward_logp(loud, b, TAU)
    m = b.resp_NT1.bool()
    torch.testing.assert_close(b.logp_NT1[m], lp[m], atol=1e-5, rtol=1e-5)
    greedy = loud.generate(PROMPTS, 1, greedy=True, max_new_tokens=8)
    _, top = forward_logp(loud, greedy, 1.0)
    m = greedy.resp_NT1.bool()
    assert torch.equal(greedy.ids_NT[:, 1:][m], top[m])


def test_every_eos_id_ends_a_response(tiny_model, tmp_path):
    """generation_config.json names [<eos>, x], x the token the model writes most often after a
    response's first: greedy and seeded sampled responses are the plain model's cut through their
    first <eos> or x, padding after."""
    plain = HFSampler(tiny_model)
    P = max(len(p) for p in PROMPTS)
    modes = ({"greedy": True}, {"temperature": TAU, "seed": 0})
    ref = [responses(plain.generate(PROMPTS, 4, max_new_tokens=8, **kw), P) for kw in modes]
    later = [t for rs in ref for r in rs for t in r[1:] if t != plain.eos_id]
    x = max(set(later), key=later.count)
    two = HFSampler(with_generation_config(tiny_model, tmp_path / "two", eos_token_id=[plain.eos_id, x]))
    cut = lambda r: r[:next((j + 1 for j, t in enumerate(r) if t in (plain.eos_id, x)), len(r))]
    ends = []
    for kw, rs in zip(modes, ref):
        g = two.generate(PROMPTS, 4, max_new_tokens=8, **kw)
        want = [cut(r) for r in rs]
        assert responses(g, P) == want
        for i, r in enumerate(want):
            assert g.resp_NT1[i, P - 1 + len(r):].sum() == 0 and g.attn_NT[i, P + len(r):].sum() == 0
            assert (g.ids_NT[i, P + len(r):] == two.pad_id).all()
        ends += [r[-1] for r in want]
    assert x in ends and set(two.eos_ids) == {plain.eos_id, x}


def test_eos_ids_read_tokenizer_and_generation_config(tiny_model, tmp_path):
    """An int or a list in generation_config.json, joined with the tokenizer's eos; without the file,
    config.json's eos_token_id (as HF's own loading falls back)."""
    from transformers import AutoTokenizer

    from ds_twocircuit.sampler import eos_ids
    tok = AutoTokenizer.from_pretrained(tiny_model)
    assert eos_ids(tiny_model, tok) == [1]
    assert eos_ids(with_generation_config(tiny_model, tmp_path / "a", eos_token_id=7), tok) == [1, 7]
    assert eos_ids(with_generation_config(tiny_model, tmp_path / "b", eos_token_id=[7, 1, 9]), tok) == [1, 7, 9]
    bare = tmp_path / "bare"
    shutil.copytree(tiny_model, bare)
    (bare / "generation_config.json").unlink()
    cfg = json.loads((bare / "config.json").read_text())
    (bare / "config.json").write_text(json.dumps({**cfg, "eos_token_id": 8}))
    assert eos_ids(str(bare), tok) == [1, 8]


def test_vllm_cut_at_the_first_of_any_eos_id():
    """`_through_eos` and the vLLM backend's Generation: each response through its first EOS id of
    any kind (without the engine: `_tensors` on stand-in outputs)."""
    assert _through_eos([5, 7, 3, 1, 4], {1, 3}) == [5, 7, 3]
    assert _through_eos([5, 1, 3], [3, 1]) == [5, 1]
    assert _through_eos([5, 6], {1, 3}) == [5, 6]
    s = object.__new__(VLLMSampler)
    s.eos_ids, s.pad_id = [1, 3], 0
    s.tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens: str(ids))
    # vLLM's FlatLogprobs of logprobs=0: one entry a position, the sampled token's
    flat = lambda ids: SimpleNamespace(token_ids=list(ids), logprobs=[-0.1 * (i + 1) for i in range(len(ids))],
                                       end_indices=list(range(1, len(ids) + 1)))
    out = lambda ids: SimpleNamespace(token_ids=ids, logprobs=flat(ids))
    g = s._tensors([([9, 9], out([5, 3, 7, 1])), ([9], out([6, 1])), ([9], out([6, 6, 6, 6]))])
    assert g.ids_NT.tolist() == [[9, 9, 5, 3, 0, 0], [0, 9, 6, 1, 0, 0], [0, 9, 6, 6, 6, 6]]
    assert g.resp_NT1.sum(1).tolist() == [2, 2, 4] and g.texts == ["[5, 3]", "[6, 1]", "[6, 6, 6, 6]"]
    assert torch.allclose(g.logp_NT1[0, 1:3], torch.tensor([-0.1, -0.2])) and g.logp_NT1[0, 3:].abs().sum() == 0
    wrong = SimpleNamespace(token_ids=[5, 3], logprobs=SimpleNamespace(token_ids=[5, 4], logprobs=[-1.0, -1.0],
                                                                      end_indices=[1, 2]))
    with pytest.raises(RuntimeError, match="other tokens"):
        s._tensors([([9], wrong)])


def test_response_lengths_with_several_eos_ids():
    """max_new_tokens = 3, eos ids {8, 9}: a full-length response ending in either is complete, one
    without is clipped; a single int id still works (8 is then an ordinary token)."""
    ids = torch.tensor([[5, 1, 2, 9, 0], [5, 1, 2, 8, 0], [5, 1, 2, 3, 0]])
    resp = torch.tensor([[1., 1., 1., 0.]] * 3)
    z = torch.zeros(3)
    r = Rollout(ids, (ids > 0).long(), resp, resp * 0, z, z, torch.arange(3))
    assert response_lengths(r, {8, 9}, 3)["response_length/clip_ratio"] == pytest.approx(1 / 3)
    assert response_lengths(r, [9, 8], 3)["response_length/clip_ratio"] == pytest.approx(1 / 3)
    assert response_lengths(r, 9, 3)["response_length/clip_ratio"] == pytest.approx(2 / 3)


def test_the_sampler_process_answers_in_order_and_reports_a_failed_load(tiny_model):
    """rollout.staleness's sampler process: a weight load sent between two generations lands between
    them (the first samples the old weights, the second the new, seeded draws equal the in-process
    sampler's, and each answer carries the tag of the weights it was made from), a rescoring gives
    generate's numbers at the weights held, a load the trainer does not wait for still raises at the
    next answer, and close ends it."""
    from ds_twocircuit.config import load_config
    from ds_twocircuit.sampler.process import SamplerProcess
    from conftest import TINY
    tc = load_config(str(TINY), [], world_size=8).tc
    local, sp = HFSampler(str(tiny_model)), SamplerProcess(str(tiny_model), tc, threads=1)
    try:
        held = {n: w.detach().clone() for n, w in local.model.named_parameters()}
        moved = {n: w + 0.05 * torch.randn_like(w) for n, w in held.items()}
        # back to back: the load is sent while the first generation may still be queued or running
        old = sp.submit("generate", PROMPTS, 2, max_new_tokens=4, temperature=TAU, seed=3)
        assert sp.load_weights(moved, None, tag=7) == sum(w.numel() * w.element_size() for w in moved.values())
        new, held_new = sp.answer(sp.submit("generate", PROMPTS, 2, max_new_tokens=4, temperature=TAU, seed=3))
        assert all(torch.equal(sp.held_weights()[n], moved[n]) for n in moved)
        want_old = local.generate(PROMPTS, 2, max_new_tokens=4, temperature=TAU, seed=3)
        local.load_weights(moved)
        want_new = local.generate(PROMPTS, 2, max_new_tokens=4, temperature=TAU, seed=3)
        got, held_old = sp.answer(old)
        assert held_old is None and held_new == 7       # each answer names the weights it was made from
        torch.testing.assert_close(got.logp_NT1, want_old.logp_NT1, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(new.logp_NT1, want_new.logp_NT1, rtol=1e-5, atol=1e-6)
        # the two weights draw differently: other log-probs, or other lengths (on an Intel Xeon every
        # response of one draw ended a token earlier, so the two are not even the same shape)
        assert want_old.logp_NT1.shape != want_new.logp_NT1.shape or not torch.allclose(want_old.logp_NT1,
                                                                                         want_new.logp_NT1)
        # rescoring at the weights held now: one teacher-forced pass gives generate's own numbers on
        # the tokens drawn from these weights, and the new weights' numbers on the old draw's tokens
        now = sp.result(sp.submit("score", new.ids_NT, new.attn_NT, new.resp_NT1, TAU))
        torch.testing.assert_close(now, new.logp_NT1, rtol=1e-5, atol=1e-5)
        stale = sp.result(sp.submit("score", got.ids_NT, got.attn_NT, got.resp_NT1, TAU))
        torch.testing.assert_close(stale, forward_logp(local, got, TAU)[0] * got.resp_NT1, rtol=1e-5, atol=1e-5)
        assert (stale - got.logp_NT1).abs().max() > 1e-3
        name = next(iter(held))
        sp.load_weights({name: torch.zeros(3, 5, 7)}, None)          # no shape a copy_ can take
        with pytest.raises(RuntimeError, match="failed to load weights"):
            sp.generate(PROMPTS, 1, max_new_tokens=2, seed=0)
    finally:
        sp.close()
    assert sp.proc.exitcode == 0
