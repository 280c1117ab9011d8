"""MATH-style rows (problem, answer) through HF `datasets`, with the `\\boxed{}` prompt template.

Accepts a local `.jsonl`/`.json`/`.parquet` file (or a directory of them) or a hub name that is
already in the local HF cache. The column names are configurable (`data.problem_key`,
`data.answer_key`); MATH's `solution` column is reduced to its last `\\boxed{...}` when no answer
column exists.
"""
from __future__ import annotations

import pathlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from datasets import Dataset

TEMPLATE = "{problem}\nPlease reason step by step, and put your final answer within \\boxed{{}}."


def load_math_rows(source: str, split: str, problem_key: str, answer_key: str) -> Dataset:
    from datasets import load_dataset
    path = pathlib.Path(source)
    if path.exists():
        files = sorted(str(p) for p in path.glob("*") if p.suffix in (".jsonl", ".json", ".parquet")) if path.is_dir() else [str(path)]
        if not files:
            raise ValueError(f"data source '{source}': no .jsonl/.json/.parquet files there")
        kind = "parquet" if files[0].endswith(".parquet") else "json"
        ds = load_dataset(kind, data_files=files, split="train")
    else:
        ds = load_dataset(source, split=split)
    if answer_key not in ds.column_names and "solution" in ds.column_names:
        ds = ds.map(lambda r: {answer_key: last_boxed(r["solution"]) or ""})
    for key in (problem_key, answer_key):
        if key not in ds.column_names:
            raise ValueError(f"data source '{source}': no column '{key}' (has {ds.column_names})")
    return ds.select_columns([problem_key, answer_key]).rename_columns(
        {k: v for k, v in ((problem_key, "problem"), (answer_key, "answer")) if k != v})


def math_prompt(problem: str) -> str:
    return TEMPLATE.format(problem=problem)


def last_boxed(text: str) -> str | None:
    """Contents of the last \\boxed{...} in text (balanced braces), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None
