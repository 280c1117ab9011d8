"""The optimizer step's order, as data: what touches the gradient between the backward and AdamW.

    guard ─► clip ─► stepped_norm ─► compare_before ─► correct ─► compare_after ─► AdamW

- guard (guard.py): wraps DeepSpeed's optimizer step, outermost, so that a non-finite loss or
  gradient on any stage skips the step on every rank before anything reads the gradient.
- clip (clip.py): the true global norm over all stages (plain fp32 only; under bf16 and ZeRO-1
  DeepSpeed's own clip is right and runs inside its step).
- stepped_norm (grads.py): the clipped gradient's squared norm (actor/grad_norm_clipped).
- compare_before (grads.py): the probe's dot products of G_comp with the dense gradient.
- correct (anchor/correction.py): G = α·G_comp + (1−α)·|G_comp| ⊙ sign(M).
- compare_after (grads.py): the same dot products of the corrected G.

Each must see the one before it: the norm and the comparison read the clipped gradient, the correction rewrites
it, the second comparison reads the rewrite. So the five pre-hooks are one hook on the optimizer
that steps (DeepSpeed's `basic_optimizer`), calling them in `STEP_ORDER`'s order; a recipe without
an anchor or a probe leaves its names out.
"""
from typing import Callable

STEP_ORDER = ("clip", "stepped_norm", "compare_before", "correct", "compare_after")


def install_step_hooks(optimizer, hooks: dict[str, Callable[[], None]]) -> tuple[str, ...]:
    """One step pre-hook on `optimizer` (a torch Optimizer) calling hooks[name]() for each name of
    STEP_ORDER that `hooks` holds, in that order; → the names, in the order they will run."""
    unknown = sorted(set(hooks) - set(STEP_ORDER))
    if unknown:
        raise ValueError(f"unknown optimizer step hook(s) {unknown}: the order knows {list(STEP_ORDER)}")
    order = tuple(n for n in STEP_ORDER if n in hooks)

    def pre_hook(*_):
        for name in order:
            hooks[name]()

    optimizer.register_step_pre_hook(pre_hook)
    return order
