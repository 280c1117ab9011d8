"""Non-finite steps (SPEC S9): a NaN/inf loss or gradient on any stage skips that optimizer step everywhere.

Every rank's optimizer step is wrapped. Before anything steps (the true-norm clip, the sign
correction, AdamW), each rank flags whether the gradients it holds or, on the last stage, the loss
of this update are non-finite; the flags, one slot per stage, are max-reduced over the whole world
(every stage and replica), so all ranks take the same decision:

    bad_s = 1 if any rank of stage s saw a non-finite value        skip ⇔ Σ_s bad_s > 0

A skipped step leaves weights, AdamW's moments and its step count as they were; DeepSpeed is told
through the optimizer's `overflow` flag, as for its own fp16 overflow skips, so it counts the step
in `skipped_steps`, does not advance the LR schedule, and clears the gradients. The weights the
sampler and the anchor then receive are the last good ones.

In plain fp32 the guard is the only check. Under bf16, fp16 or ZeRO-1 DeepSpeed's optimizer checks
the true global norm itself and skips on every rank when it is not finite (with bf16 under ZeRO-1
only when `bf16.check_grad_overflow` is on, which engine.py sets); there the guard still flags what
it can see (the lp gradients, the loss) and reports DeepSpeed's decision.

`DS_TWOCIRCUIT_INJECT_NONFINITE="STAGE@STEP[,STAGE@STEP...]"` (steps counted from 0) writes a NaN
into the first gradient of that stage at that step: the test hook for all of the above.
"""
import contextlib
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class Verdict:
    skipped: int = 0                                   # optimizer steps skipped within the rollout step
    stages: set[int] = field(default_factory=set)      # stages that saw a non-finite value


def parse_injections(text: str) -> set[tuple[int, int]]:
    """"3@7,3@8" → {(3, 7), (3, 8)}: (stage, step)."""
    out = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        stage, _, step = part.partition("@")
        out.add((int(stage), int(step)))
    return out


class FiniteGuard:
    def __init__(self, engine, pipe, loss_slot, own_skip: bool):
        """`loss_slot`: the last stage's running-pass holder (passes.LastStage); `own_skip`: this
        guard skips the step (plain fp32); else DeepSpeed's optimizer does and the guard reports."""
        self.engine, self.pipe, self.loss_slot, self.own_skip = engine, pipe, loss_slot, own_skip
        self.params = [p for p in pipe.parameters() if p.requires_grad]
        self.inject = parse_injections(os.environ.get("DS_TWOCIRCUIT_INJECT_NONFINITE", ""))
        self.step_t, self.verdict = None, None
        opt = engine.optimizer
        self._inner = opt.step
        opt.step = self._step
        if own_skip:
            opt.overflow = False

    @contextlib.contextmanager
    def checking(self, t: int):
        """The optimizer steps of rollout step t; yields the Verdict, filled as they run."""
        self.step_t, self.verdict = t, Verdict()
        try:
            yield self.verdict
        finally:
            self.step_t, self.verdict = None, None

    @torch.no_grad()
    def _local_bad(self) -> bool:
        if (self.pipe.stage_id, self.step_t) in self.inject and self.params[0].grad is not None:
            self.params[0].grad.view(-1)[0] = float("nan")
        grads_bad = any(not torch.isfinite(p.grad).all() for p in self.params if p.grad is not None)
        loss = self.loss_slot.current
        sums = getattr(loss, "sums", {}) if loss is not None else {}
        return grads_bad or any(not torch.isfinite(v).all() for v in sums.values())

    def _step(self, *args, **kwargs):
        flags = torch.zeros(self.pipe.num_stages, dtype=torch.float32)
        flags[self.pipe.stage_id] = float(self._local_bad())
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        seen = {int(s) for s in torch.nonzero(flags).flatten()}
        opt = self.engine.optimizer
        if self.own_skip:
            opt.overflow = bool(seen)
            out = None if seen else self._inner(*args, **kwargs)
        else:
            out = self._inner(*args, **kwargs)
            if seen and not getattr(opt, "overflow", False):
                raise RuntimeError(f"DeepSpeed applied an optimizer step with non-finite values on stages "
                                   f"{sorted(seen)}: enable its overflow check (bf16.check_grad_overflow)")
        if self.verdict is not None and (seen or getattr(opt, "overflow", False)):
            self.verdict.skipped += 1
            self.verdict.stages |= seen
        return out
