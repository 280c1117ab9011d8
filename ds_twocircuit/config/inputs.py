"""The run's data sources, checked before any process group exists.

A missing file or column found on rank 0 after the process group started stops eight ranks with
eight tracebacks; found here it is one `config error:` line naming the key and the path. A local
source is a file or a directory of .jsonl/.json/.parquet files (data/math_rows.py reads the same);
its first row's columns are read without `datasets` (a JSON line, or a Parquet file's schema). Any
other name is a hub data set, which must already be in the local HF cache (a config check never
waits on the network).
"""
import json
import os
import pathlib

from .schema import ConfigError, DataConfig

SUFFIXES = (".jsonl", ".json", ".parquet")


def check_data(d: DataConfig) -> None:
    if d.dataset == "synthetic":
        return
    check_source("data.dataset", d.dataset, d)
    if d.eval_dataset and d.eval_dataset != d.dataset:
        check_source("data.eval_dataset", d.eval_dataset, d)


def check_source(key: str, source: str, d: DataConfig) -> None:
    """One data source: its files exist and their first row has the problem and answer columns."""
    path = pathlib.Path(source)         # as data/math_rows.py opens it: no `~` expansion
    if path.exists():
        columns = first_row_columns(key, source, data_files(key, source, path))
        if columns is not None:
            check_columns(key, source, columns, d)
    elif looks_like_path(source):
        raise ConfigError(f"{key}='{source}': no such file or directory")
    elif not hub_dataset_cached(source):
        raise ConfigError(f"{key}='{source}': not a local file, nor a data set in the local HF cache (fetch it "
                          f"first: hf download --repo-type dataset {source})")


def data_files(key: str, source: str, path: pathlib.Path) -> list[pathlib.Path]:
    files = sorted(p for p in path.glob("*") if p.suffix in SUFFIXES) if path.is_dir() else [path]
    if not files:
        raise ConfigError(f"{key}='{source}': no .jsonl/.json/.parquet files in that directory")
    if files[0].suffix not in SUFFIXES:
        raise ConfigError(f"{key}='{source}': expected a .jsonl, .json or .parquet file")
    return files


def first_row_columns(key: str, source: str, files: list[pathlib.Path]) -> list[str] | None:
    """The first file's columns, or None where they cannot be read cheaply (a .json array)."""
    f = files[0]
    if f.suffix == ".parquet":
        import pyarrow.parquet as pq
        try:
            return pq.read_schema(f).names
        except Exception as e:   # noqa: BLE001  (pyarrow's errors have no common base)
            raise ConfigError(f"{key}='{source}': {f.name} is not a readable Parquet file ({e})") from None
    with open(f, errors="replace") as fh:
        line = next((l for l in fh if l.strip()), "")
    if not line:
        raise ConfigError(f"{key}='{source}': {f.name} is empty")
    if not line.lstrip().startswith("{"):
        return None                              # a JSON array: `datasets` reads it, with its own errors
    try:
        return list(json.loads(line))
    except json.JSONDecodeError as e:
        raise ConfigError(f"{key}='{source}': the first line of {f.name} is not a JSON object ({e})") from None


def check_columns(key: str, source: str, columns: list[str], d: DataConfig) -> None:
    if d.problem_key not in columns:
        raise ConfigError(f"{key}='{source}': no column '{d.problem_key}' (data.problem_key) in {columns}")
    if d.answer_key not in columns and "solution" not in columns:
        raise ConfigError(f"{key}='{source}': no column '{d.answer_key}' (data.answer_key), nor a 'solution' to take "
                          f"its last \\boxed{{}} from, in {columns}")


def looks_like_path(source: str) -> bool:
    """A name meant as a file: absolute, relative to here or home, or with a data file's suffix (a hub
    name is `owner/name`)."""
    return (source.startswith(("/", "./", "../", "~")) or source.endswith(SUFFIXES)
            or source.count("/") > 1 or os.sep != "/" and os.sep in source)


def hub_dataset_cached(name: str) -> bool:
    """Whether `datasets` can load the hub data set `name` without the network: its repository in the
    HF hub cache, or a copy `datasets` prepared before."""
    from huggingface_hub import constants
    repo = constants.HF_HUB_CACHE and pathlib.Path(constants.HF_HUB_CACHE) / f"datasets--{name.replace('/', '--')}"
    prepared = pathlib.Path(os.environ.get("HF_DATASETS_CACHE", pathlib.Path(constants.HF_HOME) / "datasets"))
    return bool(repo and repo.is_dir()) or any(prepared.glob(name.replace("/", "___") + "*"))
