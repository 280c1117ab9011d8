"""What stops a run early with one line: another DeepSpeed release than the tested one (at import of
ds_twocircuit.pipeline, before any process group), and a collective that waits longer than
train.collective_timeout (its config check, and a real launch whose rank 0 stalls)."""
import json
import os
import re
import subprocess
import sys
import time

import pytest

from conftest import ROOT, TINY, free_port, launch, rows
from ds_twocircuit.config import ConfigError, load_config

FAKE = "0.18.0"
# sets DeepSpeed's version as another release would before anything of ours imports it
PRELUDE = f"import deepspeed\ndeepspeed.__version__ = {FAKE!r}\n"


def test_the_version_check_accepts_the_tested_release_only():
    from ds_twocircuit.pipeline import TESTED_DEEPSPEED, DeepSpeedVersionError, check_deepspeed_version
    check_deepspeed_version(TESTED_DEEPSPEED)
    check_deepspeed_version(TESTED_DEEPSPEED + "+1a2b3c4")      # a build from source of the release
    for found in (FAKE, "0.19.9", "0.19.80", "0.20.0", "1.19.8"):
        with pytest.raises(DeepSpeedVersionError) as e:
            check_deepspeed_version(found)
        msg = str(e.value)
        assert isinstance(e.value, ImportError) and "\n" not in msg, msg
        assert f"DeepSpeed {found} is installed" in msg and f"pip install deepspeed=={TESTED_DEEPSPEED}" in msg, msg
        assert all(w in msg for w in ("_exec_schedule", "_train_schedule", "_compute_loss", "send", "step")), msg


def test_the_tested_release_is_the_pinned_one():
    from ds_twocircuit.pipeline import TESTED_DEEPSPEED
    pins = re.findall(r'"deepspeed==([^"]+)"', (ROOT / "pyproject.toml").read_text())
    assert pins == [TESTED_DEEPSPEED], pins


def test_importing_the_pipeline_with_another_deepspeed_fails_with_one_line():
    code = PRELUDE + ("import json\nerr = None\ntry:\n    import ds_twocircuit.pipeline\n"
                      "except ImportError as e:\n    err = [type(e).__name__, str(e)]\n"
                      "print('RESULT', json.dumps(err))\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    result = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
    assert p.returncode == 0 and len(result) == 1, p.stdout + p.stderr
    assert json.loads(result[0][7:]) is not None, f"ds_twocircuit.pipeline imported with DeepSpeed {FAKE}"
    kind, msg = json.loads(result[0][7:])
    assert kind == "DeepSpeedVersionError" and "\n" not in msg, msg
    assert f"DeepSpeed {FAKE} is installed" in msg and "tested with 0.19.8" in msg, msg


def test_a_launch_with_another_deepspeed_prints_one_line_before_any_process_group(tmp_path):
    """Through DeepSpeed's own launcher, 2 ranks, each interpreter given another DeepSpeed version
    (a sitecustomize on PYTHONPATH): exit status 2, one 'deepspeed version error' line naming both
    versions and the pip command, no traceback, no run files."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(PRELUDE)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path / 'site'}{os.pathsep}{ROOT}"}
    t0 = time.time()
    p = subprocess.run(["deepspeed", "--num_gpus", "2", "--master_port", str(free_port()), "launch/train.py",
                        "--ds-config", str(TINY), "--run-dir", str(tmp_path / "run"), "model.layers_per_stage=[4,4]"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    out = p.stdout + p.stderr
    lines = [l for l in out.splitlines() if l.startswith("deepspeed version error:")]
    assert p.returncode != 0 and len(lines) == 1 and "Traceback" not in out, out[-3000:]
    assert f"DeepSpeed {FAKE} is installed" in lines[0] and "pip install deepspeed==0.19.8" in lines[0], lines
    assert not (tmp_path / "run").exists() and time.time() - t0 < 60


@pytest.mark.parametrize("overrides, refused", [
    (["anchor.enabled=true", "anchor.mode=sync", "anchor.timeout=60", "train.collective_timeout=60"], True),
    (["anchor.enabled=true", "anchor.mode=sync", "train.collective_timeout=600"], True),     # anchor.timeout's default
    (["anchor.enabled=true", "anchor.mode=sync", "anchor.timeout=60", "train.collective_timeout=61"], False),
    (["anchor.enabled=true", "anchor.mode=async", "anchor.timeout=60", "train.collective_timeout=30"], False),
    (["train.collective_timeout=30"], False),                                                 # no anchor to wait for
    (["anchor.enabled=true"], False),                                                         # the defaults
])
def test_a_collective_timeout_within_the_sync_anchor_wait_is_refused_naming_both_keys(overrides, refused):
    if not refused:
        tc = load_config(str(TINY), overrides, world_size=8).tc
        assert tc.train.collective_timeout > tc.anchor.timeout or not tc.anchor.enabled or tc.anchor.mode == "async"
        return
    with pytest.raises(ConfigError) as e:
        load_config(str(TINY), overrides, world_size=8)
    assert "train.collective_timeout=" in str(e.value) and "anchor.timeout=" in str(e.value), str(e.value)


def test_a_collective_timeout_under_a_second_is_refused():
    with pytest.raises(ConfigError, match=r"train\.collective_timeout=0\.5: must be >= 1"):
        load_config(str(TINY), ["train.collective_timeout=0.5"], world_size=8)


def test_a_timed_out_collective_is_told_from_other_errors():
    """launch/train.py's reading of an error: gloo's timeout (its source location dropped), the same
    found through a chain, and nothing else."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("train_entry", ROOT / "launch" / "train.py")
    entry = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(entry)
    gloo = "[/__w/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 20000ms for recv"
    assert entry.collective_timeout(RuntimeError(gloo)) == "Timed out waiting 20000ms for recv"
    assert entry.collective_timeout(RuntimeError("Application timeout caused pair closure"))
    try:
        try:
            raise RuntimeError(gloo)
        except RuntimeError as e:
            raise ValueError("while broadcasting the batch") from e
    except ValueError as e:
        assert entry.collective_timeout(e) == "Timed out waiting 20000ms for recv"
    assert entry.collective_timeout(RuntimeError("CUDA out of memory")) is None
    assert entry.collective_timeout(ValueError("Timed out waiting for the anchor")) is None


TIMEOUT_S = 20
START_S = 60      # a tiny launch's start-up to its first rollout, with room for a loaded 2-core machine


@pytest.mark.dist
def test_a_stalled_rank_0_stops_the_run_with_a_line_naming_the_key(tiny_model, tmp_path):
    """Rank 0 sleeps 10 minutes as it starts step 1's rollout (DS_TWOCIRCUIT_SLOW, run/faults.py)
    while the 7 others wait for it in the batch's broadcast, at train.collective_timeout=20. The
    others' collectives time out together: the launch exits non-zero within start-up plus 3 x the
    timeout, with one line (the first of them to report) naming the key and its value, no
    traceback, and no step logged."""
    t0 = time.time()
    p = launch(8, tmp_path, f"train.collective_timeout={TIMEOUT_S}", "train.steps=1", "train.save_every=0",
               env={"DS_TWOCIRCUIT_SLOW": "sample@0@600"}, check=False, timeout=START_S + 3 * TIMEOUT_S + 60)
    elapsed = time.time() - t0
    out = p.stdout + p.stderr
    lines = [l[l.index("collective timeout:"):] for l in out.splitlines() if "collective timeout:" in l]
    assert p.returncode != 0 and len(lines) == 1 and "Traceback" not in out, out[-4000:]
    assert elapsed < START_S + 3 * TIMEOUT_S, f"took {elapsed:.0f}s"
    assert re.fullmatch(rf"collective timeout: rank [1-7] waited more than train\.collective_timeout="
                        rf"{TIMEOUT_S}s for the others \(.*Timed out waiting {TIMEOUT_S * 1000}ms.*\)", lines[0]), lines
    assert not (tmp_path / "metrics.jsonl").exists() or rows(tmp_path) == []
