"""DeepSpeed's top-level config keys, read off its installed source: DeepSpeed itself silently
ignores a misspelled top-level key, so we refuse any key its config code does not know.

Read with `ast`, not by importing deepspeed (which costs seconds and starts an accelerator probe):
every identifier-like string constant and config-model field name in DeepSpeed's config and
constants modules, a superset of the real top-level keys, so a typo is caught and no valid key is
refused.
"""
import ast
import difflib
import functools
import importlib.util
import pathlib
import re

from .schema import ConfigError

_KEY_RE = re.compile(r"^[a-z][a-z0-9_]*$")
_DS_DIRS = ("runtime", "monitor", "profiling", "elasticity", "compression", "nebula", "comm", "autotuning",
            "checkpoint", "utils", "inference")


def check_deepspeed_keys(ds: dict) -> None:
    known = deepspeed_known_keys()
    for key in ds:
        if key not in known:
            near = difflib.get_close_matches(key, known, n=1)
            hint = f" (did you mean '{near[0]}'?)" if near else ""
            raise ConfigError(f"DeepSpeed config: unknown top-level key '{key}'{hint}; DeepSpeed would ignore it")
    check_deepspeed_types(ds)


POSITIVE_INTS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size", "steps_per_print")
SECTIONS = ("bf16", "fp16", "zero_optimization", "optimizer", "scheduler", "pipeline", "wandb", "activation_checkpointing")


def check_deepspeed_types(ds: dict) -> None:
    """The types of the DeepSpeed keys this package reads or passes on, checked here because
    DeepSpeed checks them only inside `initialize`, after the process group exists."""
    for key in POSITIVE_INTS:
        v = ds.get(key, 1)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ConfigError(f"DeepSpeed config: {key}={v!r}: must be a positive integer")
    clip = ds.get("gradient_clipping", 1.0)
    if not isinstance(clip, (int, float)) or isinstance(clip, bool) or not 0 <= clip < float("inf"):
        raise ConfigError(f"DeepSpeed config: gradient_clipping={clip!r}: must be a number >= 0 (0: off)")
    for key in SECTIONS:
        if key in ds and not isinstance(ds[key], dict):
            raise ConfigError(f"DeepSpeed config: {key}={ds[key]!r}: must be a JSON object")
    for key in ("bf16", "fp16"):
        if not isinstance(ds.get(key, {}).get("enabled", False), bool):
            raise ConfigError(f"DeepSpeed config: {key}.enabled={ds[key]['enabled']!r}: must be true or false")
    stage = ds.get("zero_optimization", {}).get("stage", 0)
    if not isinstance(stage, int) or isinstance(stage, bool) or not 0 <= stage <= 3:
        raise ConfigError(f"DeepSpeed config: zero_optimization.stage={stage!r}: must be 0, 1, 2 or 3")
    if "optimizer" in ds and not isinstance(ds["optimizer"].get("type"), str):
        raise ConfigError(f"DeepSpeed config: optimizer.type={ds['optimizer'].get('type')!r}: must name an optimizer")


@functools.lru_cache(maxsize=1)
def deepspeed_known_keys() -> frozenset[str]:
    spec = importlib.util.find_spec("deepspeed")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("deepspeed is not installed")
    root = pathlib.Path(list(spec.submodule_search_locations)[0])
    keys: set[str] = set()
    for sub in _DS_DIRS:
        for path in (root / sub).rglob("*.py"):
            if "config" in path.name or "constants" in path.name:
                keys |= _string_keys(path)
    return frozenset(keys)


def _string_keys(path: pathlib.Path) -> set[str]:
    try:
        tree = ast.parse(path.read_text())
    except (SyntaxError, UnicodeDecodeError):
        return set()
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and _KEY_RE.match(node.value):
            out.add(node.value)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.add(node.target.id)
    return out
