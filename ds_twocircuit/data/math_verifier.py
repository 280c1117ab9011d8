"""math-verify in a helper process, with a hard wall-clock limit per answer.

Why a process and not math-verify's own `timeout_seconds`: those timeouts use SIGALRM, which exists
only in a process's main thread (off it, math-verify 0.9 raises ValueError; a fractional timeout
silently returns nothing), and a signal is not delivered while sympy sits in one long C-level call
(`\\boxed{` + 2000 nested braces ran 25 s). So rank 0 hands the (response, answer) pairs to a pool
of long-lived helper processes (`workers`, one answer each at a time), waits at most `timeout_s`
for each score, and on a miss kills that helper, starts a fresh one and scores that answer 0;
scores come back in the pairs' order, whichever helper finished first. Each helper runs
`verify.math_answer` in its own main thread, so math-verify's timeouts still end most slow answers
inside it without a restart.

Before it is sent, a response is cut to its last `\\boxed` and at most `max_chars` characters after
it (or its last `max_chars` when it has none): a 1 MB response costs what its answer costs.

The helper is started from a `forkserver` (forking a rank that runs gloo's threads is unsafe) and
imports math-verify alone; if the trainer dies, the helper sees its pipe close and exits.
"""
import collections
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import time

from .verify import math_answer

_CTX = mp.get_context("forkserver")
# the fork server loads math-verify once; each (re)started helper is a fork of it, ready at once
_CTX.set_forkserver_preload([__name__, "math_verify"])


def clip_response(response: str, max_chars: int) -> str:
    """The part of `response` math-verify reads: from its last `\\boxed`, at most `max_chars`."""
    at = response.rfind("\\boxed")
    return response[at:at + max_chars] if at >= 0 else response[-max_chars:]


def _serve(conn, inner_s: int | None) -> None:
    """The helper's loop: (response, answer) in, score out; ends when the trainer's end closes
    (so a Ctrl-C, which reaches it too, is left to the trainer: no traceback from here)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import math_verify  # noqa: F401  (loaded once, before the first answer's clock starts)
    conn.send("ready")
    while True:
        try:
            response, answer = conn.recv()
        except (EOFError, OSError):
            return
        conn.send(math_answer(response, answer, timeout_s=inner_s))


def default_workers(cap: int = 16) -> int:
    """One helper per core this process may run on, at most `cap` (each holds math-verify, ~0.1 GB)."""
    return max(1, min(cap, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


class MathVerifier:
    """`verifier.many(responses, answers)` → each 1.0 or 0.0 in order, never raising, each answer
    taking at most about `timeout_s` on one of `workers` helpers; `verifier(response, answer)` scores
    one. `timeouts` counts the answers that hit the limit (each one restarted its helper).
    `own_timeouts=False` turns math-verify's signal timeouts off inside the helpers, leaving the hard
    limit alone (the tests use it to show that limit holds by itself)."""

    def __init__(self, timeout_s: float = 5.0, max_chars: int = 2000, own_timeouts: bool = True,
                 start_timeout_s: float = 60.0, workers: int = 1):
        self.timeout_s, self.max_chars, self.start_timeout_s = timeout_s, max_chars, start_timeout_s
        # math-verify's own limit, whole seconds (a fraction returns nothing), inside ours
        self.inner_s = max(1, int(timeout_s) - 1) if own_timeouts else None
        self.timeouts = 0
        self._helpers: list = [None] * max(1, workers)      # (process, connection) or None

    def __call__(self, response: str, answer: str) -> float:
        return self.many([response], [answer])[0]

    def many(self, responses: list[str], answers: list[str]) -> list[float]:
        out = [0.0] * len(responses)
        pending = collections.deque((i, clip_response(r, self.max_chars), a, False)
                                    for i, (r, a) in enumerate(zip(responses, answers)))
        busy = {}                              # slot → (index, text, answer, retried, deadline)
        while pending or busy:
            for slot in range(len(self._helpers)):
                if pending and slot not in busy:
                    i, text, answer, retried = pending.popleft()
                    if not self._send(slot, (text, answer)):
                        if not retried:                # the helper was gone: once more on a fresh one
                            pending.appendleft((i, text, answer, True))
                        continue
                    busy[slot] = (i, text, answer, retried, time.monotonic() + self.timeout_s)
            if not busy:
                continue
            wait = max(0.0, min(d for *_, d in busy.values()) - time.monotonic())
            ready = multiprocessing.connection.wait([self._helpers[s][1] for s in busy], wait)
            for slot in list(busy):
                i, text, answer, retried, deadline = busy[slot]
                if self._helpers[slot][1] in ready:
                    del busy[slot]
                    try:
                        out[i] = float(self._helpers[slot][1].recv())
                    except (EOFError, OSError):         # it died on this answer: once more, then 0
                        self._stop(slot)
                        if not retried:
                            pending.appendleft((i, text, answer, True))
                elif time.monotonic() >= deadline:      # over the limit: it may be stuck in C
                    del busy[slot]
                    self.timeouts += 1
                    self._stop(slot)
        return out

    def _send(self, slot: int, pair) -> bool:
        if self._helpers[slot] is None or not self._helpers[slot][0].is_alive():
            self._stop(slot)
            self._helpers[slot] = self._start()
        try:
            self._helpers[slot][1].send(pair)
            return True
        except (EOFError, OSError):
            self._stop(slot)
            return False

    def _start(self):
        parent, child = _CTX.Pipe()
        proc = _CTX.Process(target=_serve, args=(child, self.inner_s), daemon=True, name="math-verify")
        proc.start()
        child.close()
        t0 = time.monotonic()
        try:
            ready = parent.poll(self.start_timeout_s) and parent.recv() == "ready"
        except (EOFError, OSError):   # it died starting: math-verify missing or broken
            ready = False
        if not ready:
            proc.join(1)
            code = proc.exitcode
            proc.kill()
            parent.close()
            raise RuntimeError(f"the math-verify helper did not start (exit code {code}, "
                               f"{time.monotonic() - t0:.0f} s): is math-verify installed?")
        return proc, parent

    def _stop(self, slot: int) -> None:
        if self._helpers[slot] is not None:
            proc, conn = self._helpers[slot]
            proc.kill()
            proc.join(5)
            conn.close()
        self._helpers[slot] = None

    def close(self) -> None:
        for slot in range(len(self._helpers)):
            self._stop(slot)

    def __getstate__(self):   # a Task may be copied; the copy starts its own helpers
        return {**self.__dict__, "_helpers": [None] * len(self._helpers)}
