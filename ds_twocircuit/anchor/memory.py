"""The anchor's memory M: an exponential moving average of its dense gradients, per parameter.

    M ← β_M·M + (1 − β_M)·G_anc            (M = 0 before the first fire)

so after fires with gradients G_1 … G_n,

    M_n = (1 − β_M)·Σ_i β_M^(n−i)·G_i

and sign(M_n) is what crosses the wire (sign.py). β_M = 0 makes M the last fire's G_anc alone.
"""
import torch


def update_memory(M: dict[str, torch.Tensor], G: dict[str, torch.Tensor], beta: float) -> dict[str, torch.Tensor]:
    """One fire: → the new M (a name M lacks starts from 0; one G lacks keeps its M). Pure: M is not changed."""
    return {**M, **{n: beta * M[n] + (1 - beta) * g if n in M else (1 - beta) * g for n, g in G.items()}}
