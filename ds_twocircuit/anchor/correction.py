"""The anchor's sign correction as an optimizer step pre-hook, on this rank's gradients:

    G = α·G_comp + (1−α)·|G_comp| ⊙ sign(M)            (anchor/sign.py)

It runs after the clip, on every slice of the gradient the optimizer is about to step
(grads.GradientViews: per-parameter .grad in fp32, flat fp32 partitions under bf16 and ZeRO-1, each
bit landing on its own coordinate), and only inside `applying(sign)`, which yields the agreement
counts of the steps taken inside (`anchor/sign_agreement` = agree / numel).
"""
import contextlib
from dataclasses import dataclass

import torch

from ..pipeline.grads import GradientViews
from .sign import agreement_count, corrected_gradient


@dataclass
class Agreement:
    agree: int | torch.Tensor = 0     # counted coordinates where sign(G_comp) = sign(M) (a device tensor once counted)
    numel: int | torch.Tensor = 0     # counted coordinates with a sign


class SignCorrection:
    def __init__(self, views: GradientViews, alpha: float):
        self.views, self.alpha = views, alpha
        self._sign, self._count = None, None

    @contextlib.contextmanager
    def applying(self, sign: dict[str, torch.Tensor] | None):
        """Within the block, correct every step's gradient with `sign` (HF name → int8 tensor of the
        parameter's shape, on its device: sign(M) ∈ {−1, 0, +1}); None (no fire published yet): G = G_comp."""
        self._sign, self._count = sign, Agreement()
        try:
            yield self._count
        finally:
            self._sign = None

    @torch.no_grad()
    def apply(self) -> None:
        if self._sign is None:
            return
        for name, g, lp, counted in self.views:
            s = self._sign[name].view(-1).narrow(0, lp, g.numel())
            if counted:
                agree, numel = agreement_count(g, s)
                self._count.agree += agree
                self._count.numel += numel
            g.copy_(corrected_gradient(g, s, self.alpha))
