"""math-verify in a helper process, with a hard wall-clock limit per answer.

Why a process and not math-verify's own `timeout_seconds`: those timeouts use SIGALRM, which exists
only in a process's main thread (off it, math-verify 0.9 raises ValueError; a fractional timeout
silently returns nothing), and a signal is not delivered while sympy sits in one long C-level call
(`\\boxed{` + 2000 nested braces ran 25 s). So rank 0 sends each (response, answer) to one
long-lived helper process, waits at most `timeout_s` for its score, and on a miss kills the
helper, starts a fresh one and scores that answer 0. The helper runs `verify.math_answer` in its own
main thread, so math-verify's timeouts still end most slow answers inside it without a restart.

Before it is sent, a response is cut to its last `\\boxed` and at most `max_chars` characters after
it (or its last `max_chars` when it has none): a 1 MB response costs what its answer costs.

The helper is started from a `forkserver` (forking a rank that runs gloo's threads is unsafe) and
imports math-verify alone; if the trainer dies, the helper sees its pipe close and exits.
"""
import multiprocessing as mp
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
    """The helper's loop: (response, answer) in, score out; ends when the trainer's end closes."""
    import math_verify  # noqa: F401  (loaded once, before the first answer's clock starts)
    conn.send("ready")
    while True:
        try:
            response, answer = conn.recv()
        except (EOFError, OSError):
            return
        conn.send(math_answer(response, answer, timeout_s=inner_s))


class MathVerifier:
    """`verifier(response, answer)` → 1.0 or 0.0, never raising and never taking longer than about
    `timeout_s`; `timeouts` counts the answers that hit the limit (each one restarted the helper).
    `own_timeouts=False` turns math-verify's signal timeouts off inside the helper, leaving the hard
    limit alone (the tests use it to show that limit holds by itself)."""

    def __init__(self, timeout_s: float = 5.0, max_chars: int = 2000, own_timeouts: bool = True,
                 start_timeout_s: float = 60.0):
        self.timeout_s, self.max_chars, self.start_timeout_s = timeout_s, max_chars, start_timeout_s
        # math-verify's own limit, whole seconds (a fraction returns nothing), inside ours
        self.inner_s = max(1, int(timeout_s) - 1) if own_timeouts else None
        self.timeouts = 0
        self._proc = self._conn = None

    def __call__(self, response: str, answer: str) -> float:
        text = clip_response(response, self.max_chars)
        for retry in (False, True):
            if self._proc is None or not self._proc.is_alive():
                self._start()
            try:
                self._conn.send((text, answer))
                if self._conn.poll(self.timeout_s):
                    return float(self._conn.recv())
            except (EOFError, OSError):   # the helper was gone (or died on this answer): once more
                self._stop()
                if not retry:
                    continue
                return 0.0
            break
        self.timeouts += 1            # over the limit: this helper may be stuck in C; a fresh one
        self._stop()
        return 0.0

    def _start(self) -> None:
        parent, child = _CTX.Pipe()
        self._proc = _CTX.Process(target=_serve, args=(child, self.inner_s), daemon=True, name="math-verify")
        self._proc.start()
        child.close()
        self._conn = parent
        t0 = time.monotonic()
        try:
            ready = parent.poll(self.start_timeout_s) and parent.recv() == "ready"
        except (EOFError, OSError):   # it died starting: math-verify missing or broken
            ready = False
        if not ready:
            self._proc.join(1)
            code = self._proc.exitcode
            self._stop()
            raise RuntimeError(f"the math-verify helper did not start (exit code {code}, "
                               f"{time.monotonic() - t0:.0f} s): is math-verify installed?")

    def _stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join(5)
            self._conn.close()
        self._proc = self._conn = None

    def close(self) -> None:
        self._stop()

    def __getstate__(self):   # a Task may be copied; the copy starts its own helper
        return {**self.__dict__, "_proc": None, "_conn": None}
