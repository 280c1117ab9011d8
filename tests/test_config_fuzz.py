"""Config fuzz: hundreds of random unknown keys, wrong types and out-of-range values through the
loader, and a handful through the real launcher. Each ends in a loaded config with finite numbers
or in one ConfigError line, never another exception (a traceback), and quickly."""
import dataclasses
import json
import math
import random
import subprocess
import time

import pytest

from conftest import FAIL_FAST_S, ROOT, TINY, ds_cmd
from ds_twocircuit.config import ConfigError, TwoCircuitConfig, as_dict, load_config

VALUES = ["-1", "0", "1", "3", "1000000000000", "-1e308", "1e308", "nan", "inf", "-inf", "abc", "''", "[1,2]",
          "[]", "{a: 1}", "true", "false", "null", "1.5", "0.5", "-0.5", "[0,0,0,0,0,0,0,8]", "💥", "1e-30"]


def dotted_keys(cls=TwoCircuitConfig, prefix="") -> list[str]:
    out = []
    for f in dataclasses.fields(cls):
        t = f.type if isinstance(f.type, type) else None
        if t is not None and dataclasses.is_dataclass(t):
            out += dotted_keys(t, f"{prefix}{f.name}.")
        else:
            out.append(f"{prefix}{f.name}")
    return out


# the switch under which a fuzzed key is read (a key nothing reads is refused as such, before its value)
CONTEXT = {"anchor.": "anchor.enabled=true", "control.": "control.enabled=true", "codec.keep": "codec.name=prf",
           "codec.payload_dtype": "codec.name=prf", "codec.fwd_": "codec.name=rotated", "codec.bwd_": "codec.name=rotated",
           "codec.boundaries": "codec.name=prf", "codec.seed": "codec.name=prf", "model.wide.": "model.embedded=wide",
           "data.system_prompt": "data.chat_template=true", "log.project": "log.wandb=true"}


def in_context(override: str) -> list[str]:
    switch = next((v for k, v in CONTEXT.items() if override.startswith(k)), None)
    return [switch, override] if switch else [override]


def cases(n: int, seed: int = 0) -> list[list[str]]:
    rng, keys = random.Random(seed), dotted_keys()
    sections = sorted({k.rsplit(".", 1)[0] for k in keys})
    out = []
    for i in range(n):
        if i % 4 == 0:     # an unknown key somewhere in the block
            key = f"{rng.choice(sections)}.{rng.choice(['bogus', 'stepz', 'lr_', 'x'])}{rng.randrange(100)}"
        else:
            key = rng.choice(keys)
        out.append(in_context(f"{key}={rng.choice(VALUES)}") +
                   (in_context(f"{rng.choice(keys)}={rng.choice(VALUES)}") if i % 3 == 0 else []))
    return out


def floats(tree) -> list[float]:
    if isinstance(tree, dict):
        return [x for v in tree.values() for x in floats(v)]
    if isinstance(tree, list):
        return [x for v in tree for x in floats(v)]
    return [tree] if isinstance(tree, float) else []


def test_fuzzed_overrides_load_or_name_the_problem():
    assert len(dotted_keys()) > 60
    accepted = refused = 0
    for overrides in cases(400):
        t0 = time.time()
        try:
            run = load_config(str(TINY), overrides, world_size=8)
        except ConfigError as e:
            msg = str(e)
            assert "\n" not in msg.strip() and msg, (overrides, msg)
            refused += 1
        except Exception as e:   # noqa: BLE001 (the point: nothing but ConfigError may escape)
            raise AssertionError(f"{overrides}: {type(e).__name__}: {e}") from e
        else:
            bad = [x for x in floats(as_dict(run.tc)) if not math.isfinite(x)]
            assert not bad, (overrides, bad)
            accepted += 1
        assert time.time() - t0 < 10, overrides
    assert refused > 200 and accepted > 20, (accepted, refused)


def test_fuzzed_deepspeed_keys_load_or_name_the_problem(tmp_path):
    rng = random.Random(1)
    base = json.loads(TINY.read_text())
    keys = ["train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size",
            "gradient_clipping", "bf16", "zero_optimization", "optimizer", "steps_per_print", "pipeline"]
    for i in range(100):
        cfg = json.loads(json.dumps(base))
        key = rng.choice(keys + [f"unknown_{i}"])
        cfg[key] = rng.choice([-1, 0, 3, 1.5, "x", None, [], {"stage": 3}, {"enabled": "maybe"}, {"type": 7}])
        path = tmp_path / "c.json"
        path.write_text(json.dumps(cfg))
        try:
            load_config(str(path), [], world_size=8)
        except ConfigError as e:
            assert str(e) and "\n" not in str(e).strip(), (key, cfg[key], str(e))
        except Exception as e:   # noqa: BLE001
            raise AssertionError(f"{key}={cfg[key]!r}: {type(e).__name__}: {e}") from e


def refused(n: int, seed: int) -> list[list[str]]:
    """The first n fuzzed override sets the loader refuses."""
    out = []
    for overrides in cases(100, seed):
        try:
            load_config(str(TINY), overrides, world_size=8)
        except ConfigError:
            out.append(overrides)
        if len(out) == n:
            return out
    raise AssertionError("the fuzzer made too few bad configs")


@pytest.mark.dist
@pytest.mark.parametrize("overrides", refused(4, seed=7) + [["grpo.temperature=abc"], ["codec.keep=-3"]])
def test_fuzzed_overrides_through_the_launcher(tmp_path, overrides):
    """8 launched ranks (warm: DeepSpeed's own launcher is under test in test_config.py): one
    'config error' line, a non-zero exit, no traceback, well before any process group could start
    (conftest.FAIL_FAST_S)."""
    t0 = time.time()
    p = subprocess.run(ds_cmd(8, "launch/train.py", "--ds-config", TINY, "--run-dir", tmp_path, *overrides),
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    lines = [l for l in (p.stdout + p.stderr).splitlines() if l.startswith("config error:")]
    assert p.returncode != 0 and len(lines) == 1, p.stdout[-2000:] + p.stderr[-2000:]
    assert "Traceback" not in p.stdout + p.stderr
    assert time.time() - t0 < FAIL_FAST_S, f"took {time.time() - t0:.1f}s"
