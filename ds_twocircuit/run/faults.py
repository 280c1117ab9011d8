"""Test hooks that kill or stall this process at an exact point of the run, for the crash and
timeout tests.

`DS_TWOCIRCUIT_KILL_AT="POINT@STEP@WHO[,POINT@STEP@WHO...]"` SIGKILLs the process WHO when it
reaches `POINT` at STEP. Points: "save" (a trainer rank as it starts the checkpoint of STEP steps,
while the other ranks write theirs; WHO is the global rank) and "fire" (the anchor process as it
starts fire STEP; WHO is `anchor<n>`, the trainer's n-th start of it, 0 the first).

`DS_TWOCIRCUIT_SLOW="POINT@STEP@SECONDS[,POINT@STEP@SECONDS...]"` makes the process that reaches
`POINT` at STEP (counted from 0) sleep SECONDS there. Points: "sample" (rank 0 as it starts step
STEP's rollout, while the other ranks wait for it in a collective: train.collective_timeout).

Unset, each costs one dictionary lookup.
"""
import os
import signal
import time


def fault_point(point: str, step: int, who: str | None = None) -> None:
    spec = os.environ.get("DS_TWOCIRCUIT_KILL_AT")
    if spec and f"{point}@{step}@{who or os.environ.get('RANK', '0')}" in spec.split(","):
        os.kill(os.getpid(), signal.SIGKILL)


def slow_point(point: str, step: int) -> None:
    spec = os.environ.get("DS_TWOCIRCUIT_SLOW")
    for item in spec.split(",") if spec else ():
        where, _, seconds = item.rpartition("@")
        if where == f"{point}@{step}":
            time.sleep(float(seconds))
