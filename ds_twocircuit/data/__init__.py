"""Prompts, answers and rewards: the synthetic task, MATH-style rows, verifiers."""
from dataclasses import dataclass
from typing import Callable

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
