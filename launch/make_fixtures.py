"""Build the real-model-path fixtures locally: `python launch/make_fixtures.py --out DIR`.

Nothing here can be downloaded, so the path a user takes with `model.path=<a Qwen2.5 directory>` and
`data.dataset=<MATH-style rows>` is exercised on stand-ins made on the spot:

- `DIR/math/{train,test}.{jsonl,parquet}`: MATH-style rows (`problem`, `solution` ending in
  `\\boxed{}`, `answer`, `type`, `level`), generated from templates, not copied from MATH: integers,
  fractions, polynomial expansions, intervals, radicals, ordered pairs, and remainders mod 2 and 3
  (the easy kinds), so math-verify meets every answer form it has to compare. Deterministic for a
  seed; test rows are disjoint from train.
- `DIR/model/`: a model of the Qwen2.5 architecture (grouped-query attention with 4 query heads over
  2 key-value heads of width 32, q/k/v biases, tied embeddings, RoPE θ = 10⁶), 8 layers so 8
  pipeline stages hold one each, and a byte-level BPE tokenizer trained here with `tokenizers` on the
  fixture text, with Qwen's special tokens and its ChatML chat template.
- The model is warm-started from its random init (`warm_start`): 160 AdamW steps of 8 train rows,
  the chat-templated prompt (half of them with `SYSTEM_PROMPT` as the system turn) → `\\boxed{answer}`
  and eos, loss on the completion only. It then writes a boxed answer of the row's form but knows
  no arithmetic: at T = 1 it gets a remainder row right with probability ≈ 0.3 (0.31 mod 2, 0.26
  mod 3, a guess among the possible remainders) and almost nothing else right. So a GRPO group of
  a remainder row usually has mixed rewards and a nonzero advantage, which a random-init model
  (every reward 0) never gives. One thread and a seeded generator: deterministic for a seed on a
  given CPU type. The warm start is most of the build: ≈ 34 s of one core (the whole build took
  7 s before it), 27–65 s of wall time on a 2-core machine as loaded by other work.
"""
import argparse
import json
import pathlib
import random
from fractions import Fraction

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# the system turn half the warm start's prompts carry (the user-path tests set it as data.system_prompt)
SYSTEM_PROMPT = "You are a careful solver."
# Qwen2.5's ChatML template, reduced to what a GRPO prompt needs: an optional system turn, a user
# turn, and the assistant's turn opened when add_generation_prompt is set
CHAT_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
                 "+ '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}"
                 "{{ '<|im_start|>assistant\\n' }}{% endif %}")


# ---- MATH-style rows ----------------------------------------------------------------------------
def _frac(q: Fraction) -> str:
    if q.denominator == 1:
        return str(q.numerator)
    sign = "-" if q < 0 else ""
    return f"{sign}\\frac{{{abs(q.numerator)}}}{{{q.denominator}}}"


def _integer(rng):
    a, b, c = rng.randint(2, 40), rng.randint(2, 40), rng.randint(-50, 50)
    return "Prealgebra", f"Compute ${a} \\times {b} {'+' if c >= 0 else '-'} {abs(c)}$.", str(a * b + c)


def _fraction(rng):
    a, b, c, d = rng.randint(1, 9), rng.randint(2, 12), rng.randint(1, 9), rng.randint(2, 12)
    q = Fraction(a, b) + Fraction(c, d)
    return "Prealgebra", f"Write $\\frac{{{a}}}{{{b}}} + \\frac{{{c}}}{{{d}}}$ as a fraction in lowest terms.", _frac(q)


def _expansion(rng):
    a, b = rng.choice([i for i in range(-9, 10) if i]), rng.choice([i for i in range(-9, 10) if i])
    s, p = a + b, a * b
    lin = "" if s == 0 else f" {'+' if s > 0 else '-'} {'' if abs(s) == 1 else abs(s)}x"
    sgn = lambda v: f"+ {v}" if v > 0 else f"- {-v}"
    return "Algebra", f"Expand $(x {sgn(a)})(x {sgn(b)})$.", f"x^2{lin} {sgn(p)}"


def _interval(rng):
    lo, hi, b = rng.randint(-20, 0), rng.randint(1, 20), rng.randint(-9, 9)
    left, right = rng.choice([("<", "("), ("\\le", "[")]), rng.choice([("<", ")"), ("\\le", "]")])
    problem = f"Solve ${lo + b} {left[0]} x {'+' if b >= 0 else '-'} {abs(b)} {right[0]} {hi + b}$. Give the answer in interval notation."
    return "Algebra", problem, f"{left[1]}{lo}, {hi}{right[1]}"


def _radical(rng):
    n, m = rng.randint(2, 30), rng.choice([2, 3, 5, 6, 7, 10, 11, 13, 14, 15])
    return "Intermediate Algebra", f"Simplify $\\sqrt{{{n * n * m}}}$.", f"{n}\\sqrt{{{m}}}"


def _pair(rng):
    x, y = rng.randint(-9, 9), rng.randint(-9, 9)
    a, b, c, d = rng.randint(1, 5), rng.randint(1, 5), rng.randint(1, 5), rng.randint(-5, -1)
    return ("Algebra", f"Solve the system ${a}x + {b}y = {a * x + b * y}$, ${c}x {'+' if d >= 0 else '-'} {abs(d)}y = {c * x + d * y}$. "
            "Give the answer as an ordered pair $(x, y)$.", f"({x}, {y})")


def _remainder(m):
    """An easy kind: m possible answers, so a model that has learnt only the answer's form guesses
    right about 1/m of the time (the rows GRPO's first steps get mixed rewards on)."""
    def kind(rng):
        n = rng.randint(10, 999)
        return "Number Theory", f"What is the remainder when ${n}$ is divided by ${m}$?", str(n % m)
    return kind


KINDS = [_integer, _fraction, _expansion, _interval, _radical, _pair, _remainder(2), _remainder(3)]


def math_rows(n: int, seed: int) -> list[dict]:
    """n distinct rows, the kinds in turn; `solution` ends in the boxed `answer`."""
    rng, rows, seen, tries = random.Random(seed), [], set(), 0
    while len(rows) < n:
        kind, problem, answer = KINDS[len(rows) % len(KINDS)](rng)
        if problem in seen:
            tries += 1
            if tries > 100 * n:   # a template's space is smaller than n / len(KINDS)
                raise ValueError(f"{n} distinct rows: the templates ran out of new problems")
            continue
        seen.add(problem)
        rows.append({"problem": problem, "solution": f"Working it through, the answer is $\\boxed{{{answer}}}$.",
                     "answer": answer, "type": kind, "level": f"Level {1 + len(rows) % 5}"})
    return rows


def write_splits(out: pathlib.Path, n_train: int, n_test: int, seed: int) -> dict[str, list[dict]]:
    import pandas as pd
    rows = math_rows(n_train + n_test, seed)
    splits = {"train": rows[:n_train], "test": rows[n_train:]}
    out.mkdir(parents=True, exist_ok=True)
    for name, part in splits.items():
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
        pd.DataFrame(part).to_parquet(out / f"{name}.parquet", index=False)
    return splits


# ---- tokenizer and model ------------------------------------------------------------------------
def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE trained on `texts`, Qwen's special tokens, ChatML template; eos = <|im_end|>
    (the end of an assistant turn, as Qwen2.5's instruct models), pad = <|endoftext|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>"])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model(vocab_size: int, pad_id: int, eos_id: int, layers: int, seed: int):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    cfg = Qwen2Config(vocab_size=vocab_size, hidden_size=128, intermediate_size=352, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, rope_theta=1e6,
                      rms_norm_eps=1e-6, tie_word_embeddings=True, pad_token_id=pad_id, eos_token_id=eos_id,
                      bos_token_id=None, torch_dtype="float32")
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(cfg)


def warm_start(model, tok, rows: list[dict], steps: int = 160, batch: int = 8, lr: float = 3e-3,
               seed: int = 0) -> list[float]:
    """Supervised steps on `rows` (the train split): the chat-templated prompt, as the trainer builds
    it (data.chat_template=true), with or without `SYSTEM_PROMPT` as its system turn (drawn per
    row and step), followed by `\\boxed{answer}` and eos; token-mean cross-entropy on that completion
    only. AdamW, no weight decay, lr warmed up linearly over 10 steps. → the loss per step.

    One thread (restored after) and a seeded generator, so the weights are a function of the seed on
    a given CPU type, not of the machine's core count or load."""
    import torch
    from ds_twocircuit.data.math_rows import math_prompt

    def encode(system: str):
        head = [{"role": "system", "content": system}] if system else []
        seqs = []
        for r in rows:
            text = tok.apply_chat_template(head + [{"role": "user", "content": math_prompt(r["problem"])}],
                                           tokenize=False, add_generation_prompt=True)
            prompt = tok(text, add_special_tokens=False)["input_ids"]
            answer = tok(f"\\boxed{{{r['answer']}}}", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            seqs.append((prompt, answer))
        return seqs

    seqs = encode("") + encode(SYSTEM_PROMPT)          # row i, then row i with the system turn
    T = max(len(p) + len(a) for p, a in seqs)
    ids = torch.full((len(seqs), T), tok.pad_token_id)
    attn = torch.zeros((len(seqs), T), dtype=torch.long)
    target = torch.zeros((len(seqs), T - 1), dtype=torch.bool)   # positions whose next token is the completion's
    for i, (p, a) in enumerate(seqs):
        ids[i, :len(p) + len(a)] = torch.tensor(p + a)
        attn[i, :len(p) + len(a)] = 1
        target[i, len(p) - 1:len(p) + len(a) - 1] = True
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        gen = torch.Generator().manual_seed(seed)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
        model.train()
        losses = []
        for _ in range(steps):
            row = torch.randint(len(rows), (batch,), generator=gen)
            idx = row + len(rows) * torch.randint(2, (batch,), generator=gen)    # with the system turn or not
            L = int(attn[idx].sum(1).max())
            hidden = model.model(input_ids=ids[idx, :L], attention_mask=attn[idx, :L]).last_hidden_state
            on = target[idx, :L - 1]                   # the head only where a completion token is next
            loss = torch.nn.functional.cross_entropy(model.lm_head(hidden[:, :-1][on]), ids[idx, 1:L][on])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            losses.append(loss.item())
        model.eval()
        return losses
    finally:
        torch.set_num_threads(threads)


def make_fixtures(out: pathlib.Path, n_train: int = 320, n_test: int = 80, vocab_size: int = 1024,
                  layers: int = 8, seed: int = 0, warm_steps: int = 160) -> dict[str, pathlib.Path]:
    """→ {"model": HF dir, "train": jsonl, "test": jsonl} under `out` (parquet beside each jsonl).
    `warm_steps=0`: the random-init model, no warm start."""
    splits = write_splits(out / "math", n_train, n_test, seed)
    from ds_twocircuit.data.math_rows import math_prompt
    texts = [math_prompt(r["problem"]) + "\n" + r["solution"] for part in splits.values() for r in part]
    tok = train_tokenizer(texts, vocab_size)
    model = build_model(len(tok), tok.pad_token_id, tok.eos_token_id, layers, seed)
    if warm_steps:
        warm_start(model, tok, splits["train"], warm_steps, seed=seed)
    model.save_pretrained(out / "model")
    tok.save_pretrained(out / "model")
    return {"model": out / "model", "train": out / "math" / "train.jsonl", "test": out / "math" / "test.jsonl"}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="fixtures", help="directory to write model/ and math/ into")
    p.add_argument("--train", type=int, default=320, help="training rows")
    p.add_argument("--test", type=int, default=80, help="held-out rows")
    p.add_argument("--layers", type=int, default=8, help="decoder layers (8: one per pipeline stage)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warm-steps", type=int, default=160, help="supervised warm-start steps (0: random init)")
    a = p.parse_args(argv)
    paths = make_fixtures(pathlib.Path(a.out), a.train, a.test, layers=a.layers, seed=a.seed, warm_steps=a.warm_steps)
    print(json.dumps({k: str(v) for k, v in paths.items()}, indent=1))


if __name__ == "__main__":
    import sys
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    main()
