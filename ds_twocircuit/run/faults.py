"""A test hook that kills this process at an exact point of the run, for the crash tests.

`DS_TWOCIRCUIT_KILL_AT="POINT@STEP@WHO[,POINT@STEP@WHO...]"` SIGKILLs the process WHO when it
reaches `POINT` at STEP. Points: "save" (a trainer rank as it starts the checkpoint of STEP steps,
while the other ranks write theirs; WHO is the global rank) and "fire" (the anchor process as it
starts fire STEP; WHO is `anchor<n>`, the trainer's n-th start of it, 0 the first). Unset, it costs
one dictionary lookup.
"""
import os
import signal


def fault_point(point: str, step: int, who: str | None = None) -> None:
    spec = os.environ.get("DS_TWOCIRCUIT_KILL_AT")
    if spec and f"{point}@{step}@{who or os.environ.get('RANK', '0')}" in spec.split(","):
        os.kill(os.getpid(), signal.SIGKILL)
