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
