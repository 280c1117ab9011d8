"""The staleness contract and the forecast: which checkpoints a fire uses, and θ̂.

Fires at t = 0, c, 2c, ... (c = `anchor.every`). With staleness K (`anchor.staleness`), fire t
uses the newest weights it may: θ(max(0, t − K)), and replays the rollout batch those weights
generated (so the trainer ships θ and the batch at steps t − K of upcoming fires; at the default
K = c those are the fire steps themselves). The forecast option extrapolates along the last shipped displacement,

    θ̂(t) = θ(t−K) + (K/c)·(θ(t−K) − θ(t−K−c)),

using the two newest checkpoints, and replays the newest batch (the one θ(t−K) generated); when
t − K − c < 0 there is no older checkpoint and θ̂ = θ(t−K).

A fire may replay a share of that batch (`anchor.replay_fraction` = φ): round(φ·B) of its B prompt
groups, drawn by a generator keyed (seed, step), whole groups so each keeps its advantages' zero
mean. Firing every step on φ = 1/c costs what firing every c steps on whole batches costs, with a
sign that is at most one step old instead of c (the compute-matched anchor).
"""
import torch


def is_fire_step(t: int, every: int) -> bool:
    return t % every == 0


def weights_step(t: int, staleness: int) -> int:
    """The step whose weights (and rollout batch) fire t replays."""
    return max(0, t - staleness)


def fires_replaying(t: int, every: int, staleness: int, steps: int) -> list[int]:
    """Fires f < steps whose weights step is t: the trainer ships θ(t) and batch t for exactly these."""
    cands = range(0, min(staleness, steps - 1) + 1, every) if t == 0 else [t + staleness]
    return [f for f in cands if is_fire_step(f, every) and f < steps and weights_step(f, staleness) == t]


def replay_groups(groups: int, fraction: float, seed: int, step: int) -> list[int]:
    """The prompt groups of step `step`'s batch a fire replays, sorted: all of them at fraction 1,
    else max(1, round(fraction·groups)) drawn by a generator keyed (seed, step)."""
    n = max(1, round(fraction * groups))
    if n >= groups:
        return list(range(groups))
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return sorted(torch.randperm(groups, generator=g)[:n].tolist())


def forecast_steps(t: int, staleness: int, every: int) -> tuple[int, int | None]:
    """(newer, older) checkpoint steps of the secant at fire t; older is None when it does not exist."""
    newer = weights_step(t, staleness)
    return newer, (newer - every if newer - every >= 0 else None)


def forecast(newer: dict, older: dict | None, staleness: int, every: int) -> dict:
    """θ̂ = θ_new + (K/c)(θ_new − θ_old), tensor by tensor (same names and shapes); θ_new if no θ_old."""
    if older is None:
        return dict(newer)
    if newer.keys() != older.keys():
        raise ValueError("forecast: the two checkpoints hold different tensors")
    r = staleness / every
    # in fp32 whatever θ was shipped in (a bf16 sampler's weights lose the step in bf16 arithmetic)
    return {n: newer[n].float() + r * (newer[n].float() - older[n].float()) for n in newer}
