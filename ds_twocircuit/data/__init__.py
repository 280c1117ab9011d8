"""Prompts, answers and rewards: the synthetic task, MATH-style rows, verifiers, the data order."""
from dataclasses import dataclass
from typing import Callable

import numpy as np
from datasets import Dataset

from .math_rows import load_math_rows, math_prompt
from .synthetic import synthetic_splits
from .verify import exact_integer, math_answer


@dataclass
class Task:
    train: Dataset            # columns: problem, answer
    held_out: Dataset
    prompt: Callable[[str], str]
    reward: Callable[[str, str], float]


def build_task(data_cfg) -> Task:
    """The synthetic task, or MATH-style rows from `data.dataset` with the boxed template."""
    if data_cfg.dataset == "synthetic":
        train, held = synthetic_splits(data_cfg.eval_size)
        return Task(train, held, prompt=lambda p: p, reward=exact_integer)
    train = load_math_rows(data_cfg.dataset, data_cfg.split, data_cfg.problem_key, data_cfg.answer_key)
    held = load_math_rows(data_cfg.eval_dataset or data_cfg.dataset, data_cfg.eval_split,
                          data_cfg.problem_key, data_cfg.answer_key)
    if len(held) > data_cfg.eval_size:
        held = held.select(range(data_cfg.eval_size))
    return Task(train, held, prompt=math_prompt, reward=math_answer)


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
