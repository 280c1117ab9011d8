"""The sampler in a process of its own, so that generation runs beside the pipeline (rollout.staleness > 0).

`SamplerProcess` is a `Sampler` (sampler/__init__.py) whose backend lives in a child process started
from rank 0 (spawned: a fresh interpreter, no copy of the trainer's state). The child serves its
requests strictly in the order they were sent, so a weight load sent between two generation
requests lands between them: the second one samples from the new weights, the first from the old,
whatever the timing. `submit` sends a request and returns at once (the trainer asks for step t+k's
batch, then trains step t); `result` waits for its answer. The blocking `Sampler` methods are
submit + result, so the held-out evaluation runs through it unchanged.

Both directions are pipes written in the caller's own thread, so a message that cannot be sent
raises where it was sent, never silently; a thread reads the child's answers as they come, so the
child never waits for the trainer to read. Weights cross as one flat shared-memory buffer per dtype
(a queue of a few hundred tensors would hold as many file descriptors). Answers come in request
order, so an answer that skips a request means that request was lost: that raises. A weight load
carries the trainer's tag for those weights (the step they are θ of) and every answer the tag of the
weights the child held when it answered, so a batch's staleness is read off what the child did, not
inferred from the order the trainer meant (`answer`). If the child
dies, `result` raises with its exit code; if the trainer's process dies (a kill, Ctrl-C's immediate
exit), the child is killed with it (Linux's parent-death signal) or stops at its next read.
"""
import ctypes
import os
import queue
import signal
import threading

import torch

PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> None:
    """SIGKILL this process when its parent exits (Linux); elsewhere the next read's EOF stops it."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:          # the parent died before the signal was armed
        os._exit(1)


def pack(tensors: dict[str, torch.Tensor]) -> tuple[list, dict]:
    """name → tensor as one flat host buffer per dtype: ([(name, dtype, shape, offset)], {dtype: flat}).
    On the host whatever device a tensor is on (rank 0's own stage on a GPU): the buffer crosses to the
    sampler's process as shared host memory."""
    index, flat = [], {}
    for dtype in sorted({t.dtype for t in tensors.values()}, key=str):
        named = [(n, t) for n, t in tensors.items() if t.dtype == dtype]
        offset = 0
        for n, t in named:
            index.append((n, dtype, tuple(t.shape), offset))
            offset += t.numel()
        flat[dtype] = torch.cat([t.detach().reshape(-1).to("cpu") for _, t in named])
    return index, flat


def unpack(index: list, flat: dict) -> dict[str, torch.Tensor]:
    out = {}
    for n, dtype, shape, offset in index:
        numel = int(torch.Size(shape).numel())
        out[n] = flat[dtype][offset:offset + numel].view(shape)
    return out


def _serve(model_dir: str, tc, device: str, threads: int, parent: int, requests, replies) -> None:
    """The child: build the configured backend, then answer (ticket, method, args, kwargs) in order
    with (ticket, result, error, the tag of the weights held) until "close" or the trainer's end of
    the pipe closes. Ctrl-C reaches the whole process group; the trainer handles it, and the child
    goes with the trainer."""
    _die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(threads)
    from . import build_sampler
    sampler = build_sampler(model_dir, tc, device)
    held = None                          # the tag of the last weights loaded (None: the model's own)
    while True:
        try:
            ticket, method, args, kwargs = requests.recv()
        except EOFError:
            return
        if method == "close":
            sampler.close()
            return
        try:
            if method == "load_weights":
                args, tag = (unpack(*args[0]), args[1]), args[2]
            out = getattr(sampler, method)(*args, **kwargs)
            if method == "load_weights":
                held = tag
            if method == "held_weights":
                out = {n: t.detach().clone() for n, t in out.items()} if out is not None else None
            reply = (ticket, out, None, held)
        except Exception as e:       # reported to the caller, which raises it
            reply = (ticket, None, f"{type(e).__name__}: {e}", held)
        try:
            replies.send(reply)
        except Exception as e:       # an answer that cannot be sent is still an answer: its error
            replies.send((ticket, None, f"the answer could not be sent: {type(e).__name__}: {e}", held))


class SamplerProcess:
    def __init__(self, model_dir: str, tc, threads: int | None = None, device=None):
        """`threads`: torch threads the child generates with (default: every core, as rank 0's
        generation uses them); `device`: where its model lives (rank 0's accelerator; the CPU by
        default)."""
        ctx = torch.multiprocessing.get_context("spawn")
        child_requests, self.requests = ctx.Pipe(duplex=False)
        self.replies, child_replies = ctx.Pipe(duplex=False)
        threads = threads or int(os.environ.get("DS_TWOCIRCUIT_GEN_THREADS", os.cpu_count() or 1))
        args = (model_dir, tc, str(device or "cpu"), threads, os.getpid(), child_requests, child_replies)
        self.proc = ctx.Process(target=_serve, args=args, name="ds_twocircuit-sampler", daemon=True)
        self.proc.start()
        child_requests.close()           # the child's ends: its exit then reads as EOF here
        child_replies.close()
        self.next_ticket, self.done, self.unread = 0, {}, set()   # unread: loads nobody waits for
        self.answers: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, name="sampler-answers", daemon=True).start()
        self.shapes = self.result(self.submit("weight_shapes"))

    def _read(self) -> None:
        """Every answer into `answers` as it comes; None once the child's end is closed (it exited)."""
        try:
            while True:
                self.answers.put(self.replies.recv())
        except (EOFError, OSError):
            self.answers.put(None)

    def submit(self, method: str, *args, **kwargs) -> int:
        """Send a request; → its ticket."""
        ticket, self.next_ticket = self.next_ticket, self.next_ticket + 1
        self.requests.send((ticket, method, args, kwargs))
        return ticket

    def result(self, ticket: int):
        """The answer to `ticket` (answers come in order; earlier ones are kept for their callers)."""
        return self.answer(ticket)[0]

    def answer(self, ticket: int) -> tuple:
        """(the answer to `ticket`, the tag of the weights the child held when it answered)."""
        while ticket not in self.done:
            item = self.answers.get()
            if item is None:
                self.answers.put(None)       # for any later caller
                self.proc.join(timeout=5)
                raise RuntimeError(f"the sampler process exited (code {self.proc.exitcode}) before answering "
                                   f"request {ticket}")
            got, out, error, held = item
            lost = sorted(u for u in self.unread if u < got) + ([ticket] if ticket < got else [])
            if lost:
                raise RuntimeError(f"the sampler process answered request {got} but never request(s) {lost}")
            if got in self.unread:           # a weight load: its answer is only read for an error
                self.unread.discard(got)
                if error is not None:
                    raise RuntimeError(f"the sampler process failed to load weights: {error}")
                continue
            self.done[got] = (out, error, held)
        out, error, held = self.done.pop(ticket)
        if error is not None:
            raise RuntimeError(f"the sampler process failed: {error}")
        return out, held

    def generate(self, prompts, n: int = 1, **kwargs):
        return self.result(self.submit("generate", prompts, n, **kwargs))

    def load_weights(self, weights, changed: set[str] | None = None, tag: int | None = None) -> int:
        """Queued behind the generations already asked for, not waited for (a failure raises at the
        next answer read); `tag`: what the answers after it report as the weights held (the trainer:
        the step they are θ of). → the bytes sent (the changed tensors')."""
        sent = {n: t for n, t in weights.items() if changed is None or n in changed}
        self.unread.add(self.submit("load_weights", pack(sent), None, tag))
        return sum(t.numel() * t.element_size() for t in sent.values())

    def weight_shapes(self) -> dict:
        return self.shapes

    def held_weights(self):
        return self.result(self.submit("held_weights"))

    def close(self) -> None:
        """Ask the child to stop after what it was sent, and wait for it to exit; answers not yet read
        are dropped."""
        if self.proc.is_alive():
            try:
                self.submit("close")
            except OSError:
                pass
        self.proc.join(timeout=30)
        if self.proc.is_alive():
            self.proc.kill()
