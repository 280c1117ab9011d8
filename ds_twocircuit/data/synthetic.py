"""The embedded default task: one-step arithmetic with a checkable integer answer.

Prompt `AB+c*d=` (AB a zero-padded 00–99, c and d single digits), answer `a+c*d` as an integer,
then end-of-sequence. Every prompt is 7 characters, so no padding is needed on the prompt side.
The 10,000 problems are split once by a fixed permutation into a held-out set and a training set,
so held-out accuracy measures generalisation, not memorised rows. Rows are HF `datasets` rows with
the same columns as a MATH-style set (`problem`, `answer`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from datasets import Dataset

SPLIT_SEED = 1234


def all_problems() -> list[tuple[str, str]]:
    return [(f"{a:02d}+{c}*{d}=", str(a + c * d)) for a in range(100) for c in range(10) for d in range(10)]


def synthetic_splits(eval_size: int = 512) -> tuple[Dataset, Dataset]:
    """→ (train, held_out) datasets with columns problem, answer. Disjoint; deterministic."""
    from datasets import Dataset
    rows = all_problems()
    order = np.random.default_rng(SPLIT_SEED).permutation(len(rows))
    held = [rows[i] for i in order[:eval_size]]
    train = [rows[i] for i in order[eval_size:]]
    as_ds = lambda rs: Dataset.from_dict({"problem": [p for p, _ in rs], "answer": [a for _, a in rs]})
    return as_ds(train), as_ds(held)
