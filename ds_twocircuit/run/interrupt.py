"""Ctrl-C ends a training launch with one line on rank 0 and nothing else.

A terminal's Ctrl-C (SIGINT) reaches every rank at once. Python's default turns it into a
KeyboardInterrupt traceback on each rank, wherever it stood, and the ranks that were waiting on it
in a collective add their own "connection closed" errors. Here every rank exits at once without
unwinding (status 130), and rank 0 first says where the run stands: the last step logged, the last
sealed checkpoint (a resume starts from it and replays the steps after it), and the command that
continues the run. The run directory is crash-consistent at any instant (run/checkpoint.py,
run/files.py), so nothing needs to be flushed first.

A rank blocked in C (a collective's wait, a device sync) runs no Python signal handler until the
call returns, so the signal also wakes a watcher thread (`signal.set_wakeup_fd`), which acts while
the main thread is blocked. SIGTERM ends a rank without a word: DeepSpeed's launcher sends it to
every rank when one fails, and also the instant it gets a Ctrl-C itself. The ranks other than 0 keep
its default. Rank 0 handles it (exit status 143), so that the launcher's SIGTERM, which can land
while rank 0 is still writing its line, waits for the line: the terminal's SIGINT reached rank 0
before the launcher could send anything, but the two can be delivered to two threads in either
order, so a SIGTERM without a SIGINT still waits 0.2 s for one before it ends the process. Whichever path ends the process, the other one, should it run in another
thread meanwhile, waits for that end instead of carrying on with the step.
"""
import os
import pathlib
import select
import signal
import shlex
import threading
import time

from .run_dir import last_step, sealed_checkpoint

_once = threading.Lock()
_holder: list[int] = []     # the thread that took `_once` (its ident)
LATE_SIGINT_S = 0.2         # how long a lone SIGTERM waits for a SIGINT sent with it


def _take() -> bool:
    """True: this thread ends the process. False: another path does; a handler re-entered in the
    thread that holds it returns, any other thread waits for the end."""
    if _once.acquire(blocking=False):
        _holder.append(threading.get_ident())
        return True
    if _holder and _holder[0] != threading.get_ident():
        while True:
            time.sleep(60)
    return False


def install(run_dir: pathlib.Path, argv: list[str], report: bool) -> None:
    """From here on a SIGINT ends this process (rank 0: `report` the line first; SIGTERM then ends it
    too, after the line if a SIGINT came with it). Main thread only."""
    def stop(*_):
        if not _take():
            return
        try:
            if report:
                line = message(run_dir, continue_command(argv))
                os.write(2, f"\n{line}\n".encode())
        finally:
            os._exit(128 + signal.SIGINT)

    def end(*_):
        if threading.current_thread() is threading.main_thread():
            time.sleep(LATE_SIGINT_S)   # a SIGINT sent with it runs `stop` meanwhile, here or in the watcher
        if _take():
            os._exit(128 + signal.SIGTERM)
    read, write = os.pipe()
    os.set_blocking(write, False)
    signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    signal.signal(signal.SIGINT, stop)     # a Python handler is what makes the C handler write the fd
    if report:
        signal.signal(signal.SIGTERM, end)

    def watch():
        while True:
            got = os.read(read, 64)
            if report and signal.SIGTERM in got and signal.SIGINT not in got and \
                    select.select([read], [], [], LATE_SIGINT_S)[0]:
                got += os.read(read, 64)
            if signal.SIGINT in got:
                return stop()
            if report and signal.SIGTERM in got:
                return end()
    threading.Thread(target=watch, name="sigint-watch", daemon=True).start()


def message(run_dir: pathlib.Path, command: str) -> str:
    step, ckpt = last_step(run_dir), sealed_checkpoint(run_dir)
    where = f"after step {step}" if step is not None else "before its first step"
    if ckpt is None:
        return (f"[train] stopped by SIGINT {where}, with no checkpoint sealed yet: start again with "
                f"{command.replace(' --resume', ' --overwrite')}")
    return (f"[train] stopped by SIGINT {where}; last sealed checkpoint {run_dir / 'checkpoints' / ckpt} (the "
            f"steps after it run again): continue with {command}")


def continue_command(argv: list[str]) -> str:
    """The launch that resumes this one: the same script, config and overrides with --resume (and
    without --overwrite); the launcher's options as this node's launch implies them (others it was
    given, such as --include or --master_port, are not visible to a rank)."""
    args = [a for a in argv[1:] if not a.startswith("--local_rank") and a not in ("--overwrite", "--resume")]
    nodes, local = int(os.environ.get("CROSS_SIZE", "1")), os.environ.get("LOCAL_SIZE", os.environ.get("WORLD_SIZE", "1"))
    head = f"deepspeed --num_gpus {local}" if nodes == 1 else "deepspeed --hostfile HOSTFILE"
    return f"{head} {shlex.join([argv[0], *args, '--resume'])}"
