"""A test hook that kills this process at an exact point of the run, for the crash tests.

`DS_TWOCIRCUIT_KILL_AT="POINT@STEP@RANK"` SIGKILLs global rank RANK when it reaches `POINT` at STEP
(for "save": as it starts the checkpoint of STEP steps, while the other ranks write theirs). Unset,
it costs one dictionary lookup.
"""
import os
import signal


def fault_point(point: str, step: int) -> None:
    spec = os.environ.get("DS_TWOCIRCUIT_KILL_AT")
    if spec and spec == f"{point}@{step}@{os.environ.get('RANK', '0')}":
        os.kill(os.getpid(), signal.SIGKILL)
