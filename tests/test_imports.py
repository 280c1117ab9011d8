"""The package's shape: no import cycle, every module imports alone, the math imports with torch alone."""
import ast
import os
import pathlib
import subprocess
import sys

from conftest import ROOT

PKG = ROOT / "ds_twocircuit"
# the pure half: these must import with torch (and numpy) only
MATH = ["ds_twocircuit.grpo.loss", "ds_twocircuit.grpo.advantages", "ds_twocircuit.grpo.rollouts",
        "ds_twocircuit.codec.prf", "ds_twocircuit.codec.geometry", "ds_twocircuit.codec.lowrank",
        "ds_twocircuit.codec.rotated",
        "ds_twocircuit.codec.boundary", "ds_twocircuit.anchor.sign", "ds_twocircuit.anchor.forecast",
        "ds_twocircuit.metrics.health", "ds_twocircuit.control", "ds_twocircuit.evaluation", "ds_twocircuit.sync.delta"]
BLOCKED = ["deepspeed", "datasets", "transformers", "omegaconf", "safetensors", "tokenizers", "wandb", "accelerate",
           "math_verify"]


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = sorted(module_name(p) for p in PKG.rglob("*.py"))


def imports_of(path: pathlib.Path) -> set[str]:
    """Every ds_twocircuit module `path` imports, at top level or inside a function."""
    mod = module_name(path)
    package = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("ds_twocircuit")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("ds_twocircuit"):
                # `from .x import y` may name a module y of package x
                out |= {f"{target}.{a.name}" if f"{target}.{a.name}" in MODULES else target for a in node.names}
    return out - {mod}


def unit(mod: str) -> str:
    """The node of the package-level graph: a subpackage, or a top-level module on its own."""
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def visit(n):
        state[n] = "open"
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == "open":
                return stack[stack.index(m):] + [m]
            if m not in state and (found := visit(m)):
                return found
        state[n] = "done"
        stack.pop()
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_no_import_cycle_between_packages_or_modules():
    edges = {module_name(p): imports_of(p) for p in PKG.rglob("*.py")}
    assert all(t in MODULES for ts in edges.values() for t in ts), {m: ts - set(MODULES) for m, ts in edges.items()}
    # importing a module runs its packages' __init__: those edges are real but not cycles of ours
    modules = {m: {t for t in ts if not m.startswith(t + ".")} for m, ts in edges.items()}
    assert cycle(modules) is None, cycle(modules)
    packages: dict[str, set[str]] = {}
    for m, ts in modules.items():
        packages.setdefault(unit(m), set()).update(unit(t) for t in ts if unit(t) != unit(m))
    assert cycle(packages) is None, cycle(packages)
    assert "anchor" in packages["trainer"] and "pipeline" in packages["anchor"]   # the graph is really read


def _import_alone(mods: str, blocked: list[str] = ()) -> tuple[str, int, str]:
    """Import `mods` (comma-separated) in a fresh interpreter with `blocked` packages unimportable."""
    code = ("import sys, importlib.abc\n"
            "class Block(importlib.abc.MetaPathFinder):\n"
            "    def find_spec(self, name, path, target=None):\n"
            f"        if name.split('.')[0] in {list(blocked)!r}: raise ImportError('blocked: ' + name)\n"
            "sys.meta_path.insert(0, Block())\n"
            f"import {mods}\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    return mods, p.returncode, p.stderr[-1500:]


# One interpreter loads the third-party packages once, then forks a child per module of ours: each
# child starts with none of ds_twocircuit loaded, so an order-dependent import (a cycle that only
# resolves when another module came first) fails there as it would in a fresh interpreter, at a
# fraction of the cost of one interpreter (torch, deepspeed, transformers: ~7 s) per module.
PRELOAD = "torch,deepspeed,datasets,transformers.models.qwen2.modeling_qwen2"
_FORK_EACH = """
import json, os, sys, traceback
for pre in sys.argv[2].split(","):   # third-party: imports the same in any order
    __import__(pre)
assert not [m for m in sys.modules if m.startswith("ds_twocircuit")]
failed = []
for mod in json.loads(sys.argv[1]):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            __import__(mod)
            code = 0
        except BaseException:
            os.write(w, traceback.format_exc()[-1500:].encode())
            code = 1
        os._exit(code)
    os.close(w)
    err = os.fdopen(r).read()
    if os.waitpid(pid, 0)[1] != 0:
        failed.append([mod, err])
print(json.dumps(failed))
"""


def test_every_module_imports_alone():
    import json
    p = subprocess.run([sys.executable, "-c", _FORK_EACH, json.dumps(MODULES), PRELOAD], cwd=ROOT, capture_output=True,
                       text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stderr[-3000:]
    failed = json.loads(p.stdout.strip().splitlines()[-1])
    assert not failed, failed


def test_the_fork_check_catches_an_order_dependent_import(tmp_path):
    """Two modules that import each other's names at the top: importing one first fails in a fresh
    interpreter; the forked check must report it (else the test above proves nothing)."""
    import json
    (tmp_path / "cyc_a.py").write_text("from cyc_b import B\nA = 1\n")
    (tmp_path / "cyc_b.py").write_text("from cyc_a import A\nB = 2\n")
    p = subprocess.run([sys.executable, "-c", _FORK_EACH, json.dumps(["cyc_a", "json"]), "json"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": f"{tmp_path}:{ROOT}"})
    failed = json.loads(p.stdout.strip().splitlines()[-1])
    assert [f[0] for f in failed] == ["cyc_a"] and "ImportError" in failed[0][1], failed


def test_math_imports_with_torch_alone():
    name, rc, err = _import_alone(", ".join(MATH), BLOCKED)
    assert rc == 0, err


def test_the_blocker_blocks():
    """A module that needs a blocked package must fail under the blocker (else the test above proves nothing)."""
    name, rc, err = _import_alone("ds_twocircuit.pipeline.engine", BLOCKED)
    assert rc != 0 and "blocked: deepspeed" in err, err


def test_vllm_is_imported_by_its_adapter_only():
    """vllm is an optional extra: only sampler/vllm.py names it, and every module (the adapter too)
    imports with vllm unimportable, so a machine without it runs the HF backend."""
    users = set()
    for p in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            if any(n.split(".")[0] == "vllm" for n in names):
                users.add(module_name(p))
    assert users == {"ds_twocircuit.sampler.vllm"}, users
    name, rc, err = _import_alone(", ".join(MODULES), ["vllm"])
    assert rc == 0, err
