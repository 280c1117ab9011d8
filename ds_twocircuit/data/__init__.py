"""Prompts, answers and rewards: the synthetic task, MATH-style rows, verifiers, the data order.

The task lives on global rank 0 (the sampler's rank); HF `datasets` is imported only when a task is
built, so the other ranks never load it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np

from .math_rows import load_math_rows, math_prompt
from .synthetic import synthetic_splits
from .math_verifier import MathVerifier, default_workers
from .verify import exact_integers

if TYPE_CHECKING:
    from datasets import Dataset


@dataclass
class Task:
    train: Dataset            # columns: problem, answer
    held_out: Dataset
    prompt: Callable[[str], str]
    score: Callable[[list[str], list[str]], list[float]]   # (responses, answers) → each one's reward, in order
    close: Callable[[], None]                                 # ends the verifier's helpers, if any
    left_out: dict[str, int]  # rows per split whose prompt is over data.max_prompt_len tokens


def build_task(data_cfg, tokenizer) -> Task:
    """The synthetic task, or MATH-style rows from `data.dataset` with the boxed template. Rows whose
    prompt is longer than `data.max_prompt_len` tokens of `tokenizer` are left out of both splits
    (as verl's `filter_overlong_prompts`), before the held-out set is cut to `data.eval_size`.
    MATH-style rows are scored by math-verify in a pool of `data.verify_workers` helper processes (0:
    one per core, at most 16), `data.verify_timeout` per answer;
    `data.chat_template` wraps every prompt in the tokenizer's chat template (counted in its length)."""
    if data_cfg.dataset == "synthetic":
        train, held = synthetic_splits(data_cfg.eval_size)
        prompt, score, close = (lambda p: p), exact_integers, (lambda: None)
    else:
        train = load_math_rows(data_cfg.dataset, data_cfg.split, data_cfg.problem_key, data_cfg.answer_key)
        held = load_math_rows(data_cfg.eval_dataset or data_cfg.dataset, data_cfg.eval_split,
                              data_cfg.problem_key, data_cfg.answer_key)
        verifier = MathVerifier(data_cfg.verify_timeout, workers=data_cfg.verify_workers or default_workers())
        prompt, score, close = math_prompt, verifier.many, verifier.close
    if data_cfg.chat_template:
        prompt = chat_prompt(tokenizer, prompt, data_cfg.system_prompt)
    train, n_train = within_length(train, prompt, tokenizer, data_cfg.max_prompt_len)
    held, n_held = within_length(held, prompt, tokenizer, data_cfg.max_prompt_len)
    if not len(train):
        raise ValueError(f"data.max_prompt_len={data_cfg.max_prompt_len}: no training prompt is that short")
    if len(held) > data_cfg.eval_size:
        held = held.select(range(data_cfg.eval_size))
    return Task(train, held, prompt, score, close, left_out={"train": n_train, "held_out": n_held})


def chat_prompt(tokenizer, inner: Callable[[str], str], system: str) -> Callable[[str], str]:
    """problem → the chat-templated text: [system turn], the user turn `inner(problem)`, the
    assistant turn opened. The sampler encodes it as is (its special tokens are in the text)."""
    head = [{"role": "system", "content": system}] if system else []
    return lambda p: tokenizer.apply_chat_template(head + [{"role": "user", "content": inner(p)}], tokenize=False,
                                                   add_generation_prompt=True)


def within_length(rows: Dataset, prompt: Callable[[str], str], tokenizer, max_len: int) -> tuple[Dataset, int]:
    """The rows whose prompt has at most `max_len` tokens (as the sampler encodes it), and how many were not."""
    ids = tokenizer([prompt(p) for p in rows["problem"]], add_special_tokens=False)["input_ids"]
    keep = [i for i, x in enumerate(ids) if len(x) <= max_len]
    return (rows if len(keep) == len(rows) else rows.select(keep)), len(rows) - len(keep)


def step_rows(n: int, per_step: int, seed: int, t: int) -> list[int]:
    """Rows of an n-row training set for step t: consecutive slices of per-epoch permutations
    (seeded by (seed, epoch)), so every prompt is seen once per epoch and a resumed run replays
    the same batches."""
    perms: dict[int, np.ndarray] = {}
    rows = []
    for i in range(t * per_step, (t + 1) * per_step):
        epoch, pos = divmod(i, n)
        if epoch not in perms:
            perms[epoch] = np.random.default_rng([seed, epoch]).permutation(n)
        rows.append(int(perms[epoch][pos]))
    return rows
