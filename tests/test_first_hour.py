"""A user's first hour, case by case as docs/usage.md's transcript table shows it: the command, what
the console shows, the exit code. Mistakes before the launch cost seconds and one line; an earlier
run is never written over by accident; Ctrl-C says where the run stands and how to go on.

Through DeepSpeed's real launcher where the launcher is part of what the user sees (the lines it
adds are its own log lines, `[date] [LEVEL] ...`, told apart from ours by that prefix).
"""
import hashlib
import os
import pathlib
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import FAIL_FAST_S, ROOT, TINY, free_port, launch, rows

pytestmark = pytest.mark.dist

LAUNCHER_LINE = re.compile(r"^\[\d{4}-\d\d-\d\d [^\]]*\] \[(INFO|WARNING|ERROR)\]")


def deepspeed(*args, **kw) -> list[str]:
    return ["deepspeed", "--num_gpus", "8", "--master_port", str(free_port()), "launch/train.py", *map(str, args)]


def ours(output: str) -> list[str]:
    """The console's lines that are not DeepSpeed's launcher logging its own steps."""
    return [l for l in output.splitlines() if l.strip() and not LAUNCHER_LINE.match(l)]


@pytest.mark.parametrize("args, line", [
    (["--ds-config", "ds_configs/prf95.json", "data.dataset=/nonexistent/train.jsonl"],
     "config error: data.dataset='/nonexistent/train.jsonl': no such file or directory"),
    (["train.steps=2"], "train.py: error: the following arguments are required: --ds-config"),
])
def test_a_mistake_before_the_launch_is_one_line_in_seconds(tmp_path, args, line):
    """Eight ranks, one message: the data-file case is one line; argparse's (a missing --ds-config)
    its usage and its error once, not eight times."""
    t0 = time.time()
    p = subprocess.run(deepspeed("--run-dir", tmp_path / "run", *args), cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    elapsed = time.time() - t0
    out = ours(p.stdout + p.stderr)
    assert p.returncode != 0 and "Traceback" not in p.stdout + p.stderr, p.stdout + p.stderr
    assert out[-1] == line and (p.stdout + p.stderr).count(line.split(":")[0] + ":") == 1, out
    assert len(out) == 1 or out[0].startswith("usage: train.py") and sum(l.startswith("usage:") for l in out) == 1, out
    assert elapsed < FAIL_FAST_S, f"{elapsed:.1f} s"
    assert not (tmp_path / "run").exists()


def tree(d: pathlib.Path) -> dict:
    return {str(p.relative_to(d)): (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(d.rglob("*")) if p.is_file()}


def test_a_run_dir_is_never_written_over_by_accident(eight, tmp_path):
    """The same command again on a finished run is refused, and nothing in its directory changed;
    --overwrite clears it whole (old checkpoints included) and runs afresh."""
    run = tmp_path / "run"
    shutil.copytree(eight, run)
    before = tree(run)
    p = launch(8, run, "train.steps=2", check=False, timeout=120)
    assert p.returncode == 2 and ours(p.stderr) == [
        f"config error: --run-dir {run} already holds a run (metrics up to step 4, checkpoint step4): continue it "
        "with --resume, start over with --overwrite (deletes that run), or choose another --run-dir"], p.stderr
    assert tree(run) == before
    launch(8, run, "train.steps=1", "--overwrite")
    assert [r["step"] for r in rows(run)] == [1]
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.is_dir()) == ["step1"]


def as_in_a_terminal() -> None:
    """SIGINT's default disposition, as a terminal's foreground job has it: a test run in the
    background of a non-interactive shell inherits it ignored, and DeepSpeed's runner would then not
    stop on it (its launcher would, exiting 1)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_prints_where_the_run_stands_and_the_command_to_go_on(tiny_model, tmp_path):
    """SIGINT to the launch's process group (a terminal's Ctrl-C) after a sealed checkpoint: rank 0
    says the step, the checkpoint and the command to continue, once; no rank prints a traceback (the
    one traceback is DeepSpeed's runner's own); the launch ends killed by SIGINT (the shell's 130).
    The console said each warning once (rank 0's), and the deprecated wandb call is gone. The
    printed command, run, continues the run to its end, offline as a second wandb run."""
    run = tmp_path / "run"
    overrides = ["train.steps=6", "train.save_every=1", "train.eval_every=100", "log.wandb=true"]
    p = subprocess.Popen(deepspeed("--ds-config", TINY, "--run-dir", run, *overrides), cwd=ROOT, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                         env={**os.environ, "WANDB_MODE": "offline"}, preexec_fn=as_in_a_terminal)
    try:
        while not (run / "metrics.jsonl").is_file() or len(rows(run)) < 2:
            assert p.poll() is None, p.communicate()[0][-3000:]
            time.sleep(0.2)
        os.killpg(p.pid, signal.SIGINT)
        out = p.communicate(timeout=90)[0]
    finally:
        p.kill()
    assert p.returncode == -signal.SIGINT, out[-3000:]
    stops = [l for l in out.replace("\r", "\n").splitlines() if l.startswith("[train] stopped by SIGINT")]
    assert len(stops) == 1, out[-3000:]
    step = len(rows(run))
    ckpt = (run / "checkpoints" / "latest").read_text().strip()
    assert stops[0].startswith(f"[train] stopped by SIGINT after step {step}; last sealed checkpoint "
                               f"{run / 'checkpoints' / ckpt} (the steps after it run again): continue with "
                               "deepspeed --num_gpus 8 launch/train.py "), stops[0]
    frames = [l for l in out.splitlines() if l.strip().startswith('File "')]
    assert "[rank" not in out and out.count("Traceback") <= 1, out[-3000:]
    assert all("deepspeed/launcher/runner.py" in f or "subprocess.py" in f or "bin/deepspeed" in f for f in frames), frames
    assert out.count("Setting accelerator to CPU") <= 3 and "deprecated" not in out, out[-3000:]
    command = shlex.split(stops[0].split("continue with ", 1)[1])
    assert command[-1] == "--resume"
    assert command[3:8] == ["launch/train.py", "--ds-config", str(TINY), "--run-dir", str(run)], command
    launch(8, run, *command[8:-1], resume=True)
    assert [r["step"] for r in rows(run)] == [1, 2, 3, 4, 5, 6]
    ids = [d.name.rsplit("-", 1)[1] for d in sorted((run / "wandb").glob("offline-run-*"))]
    assert len(set(ids)) == 2 and ids[-1] == (run / "wandb" / "run_id").read_text()   # offline: a run per start


CHILD = """
import os, pathlib, signal, sys
from ds_twocircuit.run import interrupt
interrupt.install(pathlib.Path(sys.argv[1]), ["launch/train.py", "--run-dir", sys.argv[1]], report=True)
if sys.argv[2] == "watcher":     # the main thread never takes a signal: only the watcher thread can act
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
print("ready", flush=True)
os.read(os.pipe()[0], 1)         # blocked in a system call, as in a collective's wait
"""


@pytest.mark.parametrize("path", ["main", "watcher"])
@pytest.mark.parametrize("order", [(signal.SIGINT, signal.SIGTERM), (signal.SIGTERM, signal.SIGINT)])
def test_the_launchers_sigterm_with_the_sigint_waits_for_rank_0s_line(tmp_path, path, order):
    """DeepSpeed's launcher answers a Ctrl-C by sending SIGTERM to every rank at once, so rank 0 can
    get it while it is still writing its line, or (delivered to another thread) just before the
    SIGINT: sent back to back either way, the line is still written, once, and the status is SIGINT's,
    whether the main thread's handlers or the watcher thread act. A SIGTERM alone ends rank 0 silently
    with SIGTERM's status (another rank failed)."""
    def child():
        p = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path), path], cwd=ROOT, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert p.stdout.readline() == "ready\n", p.communicate()
        return p
    p = child()
    for sig in order:
        os.kill(p.pid, sig)
    err = p.communicate(timeout=30)[1]
    assert p.returncode == 128 + signal.SIGINT, (p.returncode, err)
    assert err.count("[train] stopped by SIGINT before its first step") == 1, err
    p = child()
    p.send_signal(signal.SIGTERM)
    assert p.communicate(timeout=30)[1] == "" and p.returncode == 128 + signal.SIGTERM


def documented_user_command() -> list[str]:
    """The CPU user path's `deepspeed` command as docs/usage.md prints it (after its marker)."""
    text = (ROOT / "docs" / "usage.md").read_text().split("<!-- the CPU user path:", 1)[1]
    block = text.split("```bash\n", 1)[1].split("```", 1)[0]
    command = next(c for c in block.replace("\\\n", " ").splitlines() if c.startswith("deepspeed "))
    return shlex.split(command)


def test_the_documented_cpu_user_path_runs_as_pasted(fixtures, tmp_path):
    """docs/usage.md's command for a user's model and data on CPU, on the fixtures it builds, with
    only the run's length and batch cut to the suite's budget: it needs no layer split (derived, one
    layer a stage), trains and evaluates on the rows."""
    command = documented_user_command()
    assert command[:3] == ["deepspeed", "--num_gpus", "8"] and command[3] == "launch/train.py"
    root = pathlib.Path(fixtures["model"]).parent
    args = [a.replace("=fixtures/", f"={root}/") for a in command[4:]]
    i = args.index("--run-dir")
    args[i + 1] = str(tmp_path / "run")
    config = args[args.index("--ds-config") + 1]
    rest = [a for j, a in enumerate(args) if j not in (i, i + 1, args.index("--ds-config"), args.index("--ds-config") + 1)]
    launch(8, tmp_path / "run", *rest, "train.steps=2", "train.eval_every=2", "grpo.prompts_per_step=8",
           config=ROOT / config)
    assert [r["step"] for r in rows(tmp_path / "run")] == [1, 2]
    assert [e["step"] for e in rows(tmp_path / "run", "eval.jsonl")] == [0, 2]
    from ds_twocircuit.config import read_run_config
    assert read_run_config(tmp_path / "run")["twocircuit"]["model"]["layers_per_stage"] == [1] * 8
