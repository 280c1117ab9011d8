"""Synthetic task, MATH-style rows, verifiers."""
import json

import pytest

from ds_twocircuit.data import build_task
from ds_twocircuit.data.math_rows import last_boxed, load_math_rows, math_prompt
from ds_twocircuit.data.synthetic import synthetic_splits
from ds_twocircuit.data.verify import exact_integer, math_answer
from ds_twocircuit.model.tiny import build_tokenizer


def test_synthetic_splits_disjoint_and_correct():
    train, held = synthetic_splits(100)
    assert len(held) == 100 and len(train) == 9900
    assert not set(train["problem"]) & set(held["problem"])
    for p, a in zip(held["problem"][:20], held["answer"][:20]):
        ab, cd = p[:-1].split("+")
        c, d = cd.split("*")
        assert int(a) == int(ab) + int(c) * int(d) and len(p) == 7


def test_exact_integer_is_strict():
    assert exact_integer("42", "42") == 1.0
    assert exact_integer(" 42 ", "42") == 1.0
    for bad in ("042x", "4 2", "", "+-", "4" * 5000, "42=42"):
        assert exact_integer(bad, "42") == 0.0


def test_math_answer_and_hostile_strings():
    assert math_answer("so the answer is \\boxed{\\frac{1}{2}}", "0.5") == 1.0
    assert math_answer("\\boxed{3}", "4") == 0.0
    for hostile in ("\\boxed{" * 200, "}" * 1000, "\\frac{" + "9" * 400 + "}{0}", "\x00\\boxed{1}"):
        assert math_answer(hostile, "1") in (0.0, 1.0)


def test_math_rows_from_local_jsonl(tmp_path):
    f = tmp_path / "m.jsonl"
    rows = [{"problem": "1+1?", "solution": "It is \\boxed{2}."}, {"problem": "x?", "solution": "\\boxed{\\frac{a}{b}}"}]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds = load_math_rows(str(f), "train", "problem", "answer")
    assert ds["answer"] == ["2", "\\frac{a}{b}"]
    assert "\\boxed{}" in math_prompt("1+1?")
    assert last_boxed("a \\boxed{1} b \\boxed{{x}}") == "{x}"


def data_cfg(**kw):
    from ds_twocircuit.config import DataConfig
    return DataConfig(**kw)


def test_build_task_from_path(tmp_path):
    f = tmp_path / "m.jsonl"
    f.write_text(json.dumps({"problem": "2+2?", "answer": "4"}) + "\n")
    task = build_task(data_cfg(dataset=str(f), eval_size=8), build_tokenizer())
    assert task.score(["\\boxed{4}", "\\boxed{5}"], ["4", "4"]) == [1.0, 0.0] and len(task.held_out) == 1


def test_prompts_over_max_prompt_len_are_left_out_and_counted(tmp_path):
    """Counted in the sampler's tokens (the template included), in both splits, before eval_size cuts."""
    f = tmp_path / "m.jsonl"
    rows = [{"problem": "1" * n, "answer": "1"} for n in (3, 40, 5, 60, 2)]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = build_tokenizer()
    limit = len(tok(math_prompt("1" * 5), add_special_tokens=False)["input_ids"])
    task = build_task(data_cfg(dataset=str(f), eval_size=2, max_prompt_len=limit), tok)
    assert task.train["problem"] == ["111", "11111", "11"] and task.left_out == {"train": 2, "held_out": 2}
    assert task.held_out["problem"] == ["111", "11111"]
    synthetic = build_task(data_cfg(eval_size=16), tok)   # every synthetic prompt is 7 tokens
    assert synthetic.left_out == {"train": 0, "held_out": 0} and len(synthetic.train) == 10000 - 16
    with pytest.raises(ValueError, match="max_prompt_len"):
        build_task(data_cfg(dataset=str(f), max_prompt_len=1), tok)


# ---- math-verify under hostile output, bounded where the trainer calls it ------------------------
HOSTILE = {
    "huge number": "\\boxed{" + "9" * 200_000 + "}",
    "tower": "\\boxed{10^{10^{10^{10^{10}}}}}",
    "nested braces": "\\boxed{" + "{" * 3000 + "1" + "}" * 3000 + "}",
    "1 MB response": "x" * (1 << 20) + " \\boxed{1}",
    "unicode": "答案是 \\boxed{½} ∞ 𝔘 \u202e\x00",
    "malformed": "\\boxed{\\frac{1}{\\sqrt{}}} \\left( \\begin{matrix} \\end{pmatrix} \\boxed{",
    "only closers": "}" * 100_000,
}


def test_verifier_scores_answer_forms():
    from ds_twocircuit.data.math_verifier import MathVerifier
    v = MathVerifier(timeout_s=5)
    try:
        assert v("so \\boxed{\\frac{1}{2}}", "0.5") == 1.0
        assert v("\\boxed{(1, 3]}", "(1,3]") == 1.0
        assert v("\\boxed{2x+2}", "2(x+1)") == 1.0
        assert v("\\boxed{-7}", "-7") == 1.0
        assert v("\\boxed{3}", "4") == 0.0 and v("no answer", "4") == 0.0
    finally:
        v.close()


def test_verifier_is_bounded_and_never_raises_in_any_thread():
    """Each hostile response scores 0 or 1 within the limit plus a helper restart, from the main
    thread and from a worker thread (where math-verify's own signal timeouts cannot work); a helper
    killed from outside is replaced on the next answer."""
    import concurrent.futures
    import time

    from ds_twocircuit.data.math_verifier import MathVerifier
    limit = 2.0
    v = MathVerifier(timeout_s=limit)
    try:
        v("\\boxed{1}", "1")                                   # the helper's start is not timed

        def timed(text):
            t0 = time.monotonic()
            score = v(text, "1")
            return score, time.monotonic() - t0

        for name, text in HOSTILE.items():
            for run in (timed, lambda t: concurrent.futures.ThreadPoolExecutor(1).submit(timed, t).result()):
                score, took = run(text)
                # a miss also waits for the replacement helper (math-verify's import: a few s here)
                assert score in (0.0, 1.0) and took < limit + 15, (name, score, took)
        assert v(HOSTILE["1 MB response"], "1") == 1.0         # cut to its last \boxed, still scored
        v._helpers[0][0].kill()
        assert v("\\boxed{1}", "1") == 1.0
    finally:
        v.close()


def test_the_hard_limit_holds_alone():
    """math-verify's own timeouts off: 900 nested braces (20 s of parsing here) are cut at the limit,
    the helper is replaced, and the next answer is scored."""
    import time

    from ds_twocircuit.data.math_verifier import MathVerifier
    v = MathVerifier(timeout_s=1, own_timeouts=False)
    try:
        assert v("\\boxed{1}", "1") == 1.0
        t0 = time.monotonic()
        assert v("\\boxed{" + "{" * 900 + "1" + "}" * 900 + "}", "1") == 0.0
        assert time.monotonic() - t0 < 1 + 5 and v.timeouts == 1
        assert v("\\boxed{2}", "2") == 1.0
    finally:
        v.close()


def test_a_pool_scores_in_order_and_bounds_each_answer():
    """Two helpers: scores come back in the pairs' order whichever helper finished first; a stuck
    answer (math-verify's timeouts off) costs one limit on one helper while the other goes on, is
    scored 0 and its helper replaced; a helper killed between calls is replaced too."""
    import time

    from ds_twocircuit.data.math_verifier import MathVerifier
    stuck = "\\boxed{" + "{" * 900 + "1" + "}" * 900 + "}"
    pairs = [(f"\\boxed{{{k}}}", str(k if k % 3 else k + 1)) for k in range(12)]
    pairs.insert(5, (stuck, "1"))
    v = MathVerifier(timeout_s=1, own_timeouts=False, workers=2)
    try:
        assert v.many(["\\boxed{1}"] * 2, ["1", "2"]) == [1.0, 0.0]       # both helpers started, untimed
        t0 = time.monotonic()
        got = v.many([p for p, _ in pairs], [a for _, a in pairs])
        took = time.monotonic() - t0
        want = [0.0 if p == stuck else float(a == p[7:-1]) for p, a in pairs]
        assert got == want and v.timeouts == 1 and took < 1 + 5, (got, took)
        next(h for h in v._helpers if h is not None)[0].kill()
        assert v.many(["\\boxed{7}", "\\boxed{8}", "\\boxed{9}"], ["7", "8", "0"]) == [1.0, 1.0, 0.0]
    finally:
        v.close()


def test_clip_response_keeps_the_last_boxed():
    from ds_twocircuit.data.math_verifier import clip_response
    assert clip_response("a \\boxed{1} b \\boxed{22} c", 9) == "\\boxed{22"
    assert clip_response("x" * 50, 10) == "x" * 10


# ---- the user-path fixtures (launch/make_fixtures.py) and the chat template -------------------------
def test_fixture_rows_cover_the_answer_forms_and_verify_against_themselves(fixtures):
    from ds_twocircuit.data.math_verifier import MathVerifier
    train = [json.loads(l) for l in fixtures["train"].read_text().splitlines()]
    test = [json.loads(l) for l in fixtures["test"].read_text().splitlines()]
    assert len(train) == 320 and len(test) == 80 and not {r["problem"] for r in train} & {r["problem"] for r in test}
    answers = [r["answer"] for r in train]
    assert any("\\frac" in a for a in answers) and any("x^2" in a for a in answers) and any("\\sqrt" in a for a in answers)
    assert any(a[0] in "([" and a[-1] in ")]" and "," in a for a in answers) and any(a.lstrip("-").isdigit() for a in answers)
    assert {r["answer"] for r in train if r["type"] == "Number Theory"} == {"0", "1", "2"}     # remainders mod 2 and 3
    v = MathVerifier(timeout_s=5)
    try:
        assert all(v(r["solution"], r["answer"]) == 1.0 for r in train[:60] + test[:30])
        # a neighbour's answer (another kind, or a remainder with another value) does not verify
        others = [(a, b) for a, b in zip(train[:60], train[1:61]) if a["answer"] != b["answer"]]
        assert len(others) > 50 and sum(v(a["solution"], b["answer"]) for a, b in others) == 0.0
    finally:
        v.close()
    as_parquet = load_math_rows(str(fixtures["train"].with_suffix(".parquet")), "train", "problem", "answer")
    assert as_parquet[:] == load_math_rows(str(fixtures["train"]), "train", "problem", "answer")[:]


def test_fixture_model_has_the_qwen25_layout_and_a_bpe_tokenizer(fixtures):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(fixtures["model"])
    m = AutoModelForCausalLM.from_pretrained(fixtures["model"])
    c = m.config
    assert c.model_type == "qwen2" and c.tie_word_embeddings and c.num_hidden_layers == 8
    assert c.num_key_value_heads < c.num_attention_heads and m.model.layers[0].self_attn.k_proj.bias is not None
    assert c.vocab_size == len(tok) and tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    text = "Solve $\\frac{1}{2} < x$: 答案 ½ \\boxed{(1, 3]}"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text and len(ids) < len(text.encode())      # byte-level BPE: merges, lossless


def test_fixture_model_is_warm_started_to_mixed_rewards(fixtures):
    """The warm start (make_fixtures.warm_start) leaves a model that writes `\\boxed{...}<|im_end|>`
    and, at T = 1, gets a remainder row right with a probability well inside (0, 1): a group of 4
    samples of such a row has mixed rewards, the nonzero advantage GRPO learns from. Probabilities
    teacher-forced on the chat prompt with the user-path tests' system turn, on the train rows."""
    import torch
    from make_fixtures import SYSTEM_PROMPT
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(fixtures["model"])
    m = AutoModelForCausalLM.from_pretrained(fixtures["model"]).eval()
    train = [json.loads(l) for l in fixtures["train"].read_text().splitlines()]
    seqs = []
    for r in train[:160]:
        chat = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": math_prompt(r["problem"])}]
        text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        prompt = tok(text, add_special_tokens=False)["input_ids"]
        answer = tok(f"\\boxed{{{r['answer']}}}", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        seqs.append((prompt, answer))
    T = max(len(a) + len(b) for a, b in seqs)
    ids = torch.tensor([a + b + [tok.pad_token_id] * (T - len(a) - len(b)) for a, b in seqs])
    attn = (torch.arange(T) < torch.tensor([len(a) + len(b) for a, b in seqs])[:, None]).long()
    with torch.no_grad():
        logp = torch.log_softmax(m(input_ids=ids, attention_mask=attn).logits, -1)
    p, form = {}, {}
    for r, (prompt, answer), lp in zip(train, seqs, logp):
        at = lp[len(prompt) - 1:len(prompt) + len(answer) - 1]
        token_logp = at.gather(-1, torch.tensor(answer)[:, None]).squeeze(-1)
        p.setdefault(r["type"], []).append(token_logp.sum().exp().item())
        form.setdefault(r["type"], []).append(token_logp[[0, 1, -1]].sum().exp().item())   # `\\`, `boxed`, eos
    rem = torch.tensor(p["Number Theory"])
    mixed = 1 - rem ** 4 - (1 - rem) ** 4                  # P(a group of 4 is neither all right nor all wrong)
    print({k: round(sum(v) / len(v), 3) for k, v in form.items()}, "remainders:", rem.mean().item(), mixed.mean().item())
    assert 0.15 < rem.mean() < 0.6 and mixed.mean() > 0.6, (rem.mean(), mixed.mean())
    # the form is learnt on every kind: `\\boxed` first, eos after the answer
    assert all(sum(v) / len(v) > 0.8 for v in form.values()), form


def test_chat_template_wraps_prompts_and_counts_in_their_length(fixtures):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(fixtures["model"])
    kw = dict(dataset=str(fixtures["train"]), eval_dataset=str(fixtures["test"]), eval_size=80)
    plain = build_task(data_cfg(**kw), tok)
    chat = build_task(data_cfg(**kw, chat_template=True, system_prompt="Be brief."), tok)
    problem = plain.train["problem"][0]
    text = chat.prompt(problem)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n" + math_prompt(problem) +
                    "<|im_end|>\n<|im_start|>assistant\n")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 3     # one token each, as the sampler encodes
    assert build_task(data_cfg(**kw, chat_template=True), tok).prompt(problem).startswith("<|im_start|>user\n")
    # the limit counts the template's tokens: a limit every plain prompt meets leaves chat ones out
    longest = max(len(tok(plain.prompt(p), add_special_tokens=False)["input_ids"]) for p in plain.train["problem"])
    short = build_task(data_cfg(**kw, chat_template=True, max_prompt_len=longest), tok)
    assert build_task(data_cfg(**kw, max_prompt_len=longest), tok).left_out["train"] == 0
    assert short.left_out["train"] > 0
