"""Ctrl-C (SIGINT) and SIGTERM end a training launch with one line on rank 0 and nothing else.

A terminal's Ctrl-C reaches every rank at once. Python's default turns it into a KeyboardInterrupt
traceback on each rank, wherever it stood, and the ranks that were waiting on it in a collective
add their own "connection closed" errors. Here every rank exits at once without unwinding
(128 + the signal: 130 for SIGINT), and rank 0 first says where the run stands: the last step
logged, the last sealed checkpoint (a resume starts from it and replays the steps after it), and
the command that continues the run. The run directory is crash-consistent at any instant
(run/checkpoint.py, run/files.py), so nothing needs to be flushed first.
"""
import os
import shlex
import signal
import sys
import pathlib

from .run_dir import last_step, sealed_checkpoint


def install(run_dir: pathlib.Path, argv: list[str], report: bool) -> None:
    """Handle SIGINT and SIGTERM for the rest of the process (rank 0: `report`)."""
    def handler(signum, frame):
        if report:
            print("\n" + message(run_dir, signal.Signals(signum).name, continue_command(argv)), file=sys.stderr,
                  flush=True)
        sys.stdout.flush()
        os._exit(128 + signum)
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, handler)


def message(run_dir: pathlib.Path, signame: str, command: str) -> str:
    step, ckpt = last_step(run_dir), sealed_checkpoint(run_dir)
    where = f"after step {step}" if step is not None else "before its first step"
    if ckpt is None:
        return (f"[train] stopped by {signame} {where}, with no checkpoint sealed yet: start again with "
                f"{command.replace(' --resume', ' --overwrite')}")
    return (f"[train] stopped by {signame} {where}; last sealed checkpoint {run_dir / 'checkpoints' / ckpt} (the "
            f"steps after it run again): continue with {command}")


def continue_command(argv: list[str]) -> str:
    """The launch that resumes this one: the same script, config and overrides with --resume (and
    without --overwrite); the launcher's options as this node's launch implies them."""
    args = [a for a in argv[1:] if not a.startswith("--local_rank") and a not in ("--overwrite", "--resume")]
    nodes, local = int(os.environ.get("CROSS_SIZE", "1")), os.environ.get("LOCAL_SIZE", os.environ.get("WORLD_SIZE", "1"))
    head = f"deepspeed --num_gpus {local}" if nodes == 1 else "deepspeed --hostfile HOSTFILE"
    return f"{head} {shlex.join([argv[0], *args, '--resume'])}"
