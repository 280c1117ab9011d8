"""Gradient clipping by the true global norm across all pipeline stages (plain fp32 path).

DeepSpeed 0.19.8's fp32 pipeline path treats the pipe group as model-parallel and clips by a norm
that counts only stage 0's gradients (measured: the norm it reports is stage 0's). Here every
stage's squared norm is all-reduced over the pipe group, the tied head's duplicate counted once, and all stages scale by
the same factor, before the optimizer consumes the gradient (the first of the step's pre-hooks,
step_order.py):

    n = sqrt(Σ_stages Σ_params ‖g‖²),    g ← g · c/(n + 1e-6)   when n > c = gradient_clipping

In bf16 and ZeRO-1 DeepSpeed's own clip is already correct; there this only reads its norm.
"""
import torch

from . import comm


class TrueNormClip:
    def __init__(self, engine, pipe, max_norm: float, active: bool):
        from ..model.pipe import Embed
        self.engine, self.max_norm, self.active, self.last_norm = engine, max_norm, active, float("nan")
        dup = {id(p) for m in pipe.modules() if isinstance(m, Embed) and pipe.stage_id != 0 for p in m.parameters()}
        self.params = [p for p in pipe.parameters() if p.requires_grad and id(p) not in dup]
        self.group = engine.grid.get_pipe_parallel_group()

    @torch.no_grad()
    def clip(self) -> None:
        sq = torch.zeros((), dtype=torch.float64, device=comm.device())
        for p in self.params:
            if p.grad is not None:
                sq += p.grad.double().pow(2).sum()
        comm.all_reduce_sum_(sq, self.group)
        self.last_norm = float(sq.sqrt())
        if self.max_norm > 0 and self.last_norm > self.max_norm:
            coef = self.max_norm / (self.last_norm + 1e-6)
            for p in self.engine.module.parameters():   # every copy, tied duplicates included
                if p.grad is not None:
                    p.grad.mul_(coef)

    def norm(self) -> float:
        """The global gradient norm of the last optimizer step, before clipping."""
        return self.last_norm if self.active else float(self.engine.get_global_grad_norm() or float("nan"))
