"""The sampler in a process of its own, so that generation runs beside the pipeline (rollout.staleness > 0).

`SamplerProcess` is a `Sampler` (sampler/__init__.py) whose backend lives in a child process started
from rank 0 (spawned: a fresh interpreter, no copy of the trainer's state). The child serves its
requests strictly in the order they were sent, so a weight load sent between two generation
requests lands between them: the second one samples from the new weights, the first from the old,
whatever the timing. `submit` sends a request and returns at once (the trainer asks for step t+k's
batch, then trains step t); `result` waits for its answer. The blocking `Sampler` methods are
submit + result, so the held-out evaluation runs through it unchanged.

Weights cross as copies of the changed tensors (a queue shares a tensor's storage instead of copying
it, and the trainer's mirror is updated in place by the next sync while the child may not have read
it yet). If the child dies, the next `result` raises with its exit code instead of waiting forever.
"""
import os
import queue
import signal

import torch


def _serve(model_dir: str, tc, threads: int, parent: int, requests, replies) -> None:
    """The child: build the configured backend, then answer (ticket, method, args, kwargs) in order;
    exit when the trainer's process is gone (killed, it cannot send "close"). Ctrl-C reaches the
    whole process group: the trainer handles it (run/interrupt.py) and closes the child."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(threads)
    from . import build_sampler
    sampler = build_sampler(model_dir, tc)
    while True:
        try:
            ticket, method, args, kwargs = requests.get(timeout=5.0)
        except queue.Empty:
            if os.getppid() != parent:
                return
            continue
        if method == "close":
            sampler.close()
            replies.put((ticket, None, None))
            return
        try:
            out = getattr(sampler, method)(*args, **kwargs)
            if method == "held_weights":
                out = {n: t.detach().clone() for n, t in out.items()} if out is not None else None
            replies.put((ticket, out, None))
        except Exception as e:       # reported to the caller, which raises it
            replies.put((ticket, None, f"{type(e).__name__}: {e}"))


class SamplerProcess:
    def __init__(self, model_dir: str, tc, threads: int | None = None):
        """`threads`: torch threads the child generates with (default: every core, as rank 0's
        generation uses them)."""
        ctx = torch.multiprocessing.get_context("spawn")
        self.requests, self.replies = ctx.Queue(), ctx.Queue()
        threads = threads or int(os.environ.get("DS_TWOCIRCUIT_GEN_THREADS", os.cpu_count() or 1))
        self.proc = ctx.Process(target=_serve, args=(model_dir, tc, threads, os.getpid(), self.requests, self.replies),
                                name="ds_twocircuit-sampler", daemon=True)
        self.proc.start()
        self.next_ticket, self.done, self.unread = 0, {}, set()   # unread: loads nobody waits for
        self.shapes = self.result(self.submit("weight_shapes"))

    def submit(self, method: str, *args, **kwargs) -> int:
        """Send a request; → its ticket."""
        ticket, self.next_ticket = self.next_ticket, self.next_ticket + 1
        self.requests.put((ticket, method, args, kwargs))
        return ticket

    def result(self, ticket: int):
        """The answer to `ticket` (answers come in order; earlier ones are kept for their callers)."""
        while ticket not in self.done:
            try:
                got, out, error = self.replies.get(timeout=5.0)
            except queue.Empty:
                if not self.proc.is_alive():
                    raise RuntimeError(f"the sampler process exited with code {self.proc.exitcode} "
                                       f"before answering request {ticket}") from None
                continue
            if got in self.unread:           # a weight load: its answer is only read for an error
                self.unread.discard(got)
                if error is not None:
                    raise RuntimeError(f"the sampler process failed to load weights: {error}")
                continue
            self.done[got] = (out, error)
        out, error = self.done.pop(ticket)
        if error is not None:
            raise RuntimeError(f"the sampler process failed: {error}")
        return out

    def generate(self, prompts, n: int = 1, **kwargs):
        return self.result(self.submit("generate", prompts, n, **kwargs))

    def load_weights(self, weights, changed: set[str] | None = None) -> int:
        """Queued behind the generations already asked for, not waited for (a failure raises at the
        next answer read); → the bytes sent (the changed tensors')."""
        sent = {n: t.detach().clone() for n, t in weights.items() if changed is None or n in changed}
        self.unread.add(self.submit("load_weights", sent, None))
        return sum(t.numel() * t.element_size() for t in sent.values())

    def weight_shapes(self) -> dict:
        return self.shapes

    def held_weights(self):
        return self.result(self.submit("held_weights"))

    def close(self) -> None:
        """Ask the child to stop after what it was sent, and wait for it to exit; answers not yet read
        are dropped (a tensor in one cannot be rebuilt once its sender has exited)."""
        if self.proc.is_alive():
            self.submit("close")
        self.proc.join(timeout=30)
        if self.proc.is_alive():
            self.proc.kill()
