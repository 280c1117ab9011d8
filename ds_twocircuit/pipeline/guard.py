"""Non-finite steps: a NaN/inf loss or gradient on any stage skips that optimizer step everywhere.

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
it can see (the gradients DeepSpeed is about to step from, the loss), so the row names the stage,
and reports DeepSpeed's decision.

`DS_TWOCIRCUIT_INJECT_NONFINITE="STAGE@STEP[,STAGE@STEP...]"` (steps counted from 0) writes a NaN
into the first gradient of that stage in the backward of that step's updates (a hook on the
parameter's gradient, so it reaches DeepSpeed's reduction and its bf16/ZeRO partitions as a real
one would): the test hook for all of the above.
"""
import contextlib
import os
from dataclasses import dataclass, field

import torch

from . import comm


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


def stepped_gradients(opt) -> list[torch.Tensor]:
    """The gradients DeepSpeed's mixed-precision optimizer steps from, this rank's share: ZeRO-1's
    reduced flat partitions, or bf16's fp32 accumulators (by then the bf16 .grad may be freed)."""
    if hasattr(opt, "averaged_gradients"):       # ZeRO stage 1/2 (stage_1_and_2.py): a flat tensor or a list
        out = []
        for gs in opt.averaged_gradients.values():
            out += [gs] if torch.is_tensor(gs) else [g for g in gs or [] if g is not None]
        return out
    return [g for g in getattr(opt, "fp32_groups_gradients_flat", []) if g is not None]   # bf16_optimizer.py


class FiniteGuard:
    def __init__(self, engine, pipe, loss_slot, own_skip: bool):
        """`loss_slot`: the last stage's running-pass holder (passes.LastStage); `own_skip`: this
        guard skips the step (plain fp32); else DeepSpeed's optimizer does and the guard reports."""
        self.engine, self.pipe, self.loss_slot, self.own_skip = engine, pipe, loss_slot, own_skip
        self.params = [p for p in pipe.parameters() if p.requires_grad]
        self.inject = parse_injections(os.environ.get("DS_TWOCIRCUIT_INJECT_NONFINITE", ""))
        self.step_t, self.verdict = None, None
        if any(stage == pipe.stage_id for stage, _ in self.inject):
            self.params[0].register_hook(self._poison)
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

    def _poison(self, g: torch.Tensor) -> torch.Tensor:
        if (self.pipe.stage_id, self.step_t) not in self.inject:
            return g
        g = g.clone()
        g.view(-1)[0] = float("nan")
        return g

    @torch.no_grad()
    def _local_bad(self) -> bool:
        """Whether any gradient or loss sum of this rank is not finite: reduced on the device, one host
        read (not one per tensor)."""
        grads = [p.grad for p in self.params if p.grad is not None] + stepped_gradients(self.engine.optimizer)
        loss = self.loss_slot.current
        sums = getattr(loss, "sums", {}) if loss is not None else {}
        finite = [torch.isfinite(t).all() for t in [*grads, *sums.values()]]
        return bool(finite) and not bool(torch.stack(finite).all())

    def _step(self, *args, **kwargs):
        flags = torch.zeros(self.pipe.num_stages, dtype=torch.float32)
        flags[self.pipe.stage_id] = float(self._local_bad())
        comm.max_over_world(flags)
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


class TrainingStopped(RuntimeError):
    """The run cannot go on: train.max_skipped_steps steps in a row skipped (every rank raises it at
    the same step); launch/train.py prints it as one line."""

    label = "training stopped"
