"""Group-normalised advantages (GRPO's critic-free baseline).

For prompt p with G samples and rewards r_p1..r_pG:

    Â_pi = (r_pi − mean_j r_pj) / (std_j r_pj + ε)

std is the unbiased sample standard deviation (as verl's `compute_grpo_outcome_advantage`). A group
whose rewards are all equal gets Â = 0 exactly (not the rounding residue of r − mean, which a
reward like 0.9 leaves in float32): it carries no learning signal, and with β = 0 no gradient, so the
trainer may leave it out of the update (`zero_advantage_groups`). Every token of a response
shares its sequence's advantage.
"""
import torch


def group_advantages(rewards_N: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """rewards_N: (B·G,) with the G samples of a prompt adjacent → advantages (B·G,), float32."""
    r_BG = rewards_N.float().view(-1, group_size)
    mean_B1 = r_BG.mean(dim=1, keepdim=True)
    std_B1 = r_BG.std(dim=1, keepdim=True)
    adv_BG = (r_BG - mean_B1) / (std_B1 + eps)
    return torch.where(zero_advantage_groups(rewards_N, group_size)[:, None], 0.0, adv_BG).view(-1)


def zero_advantage_groups(rewards_N: torch.Tensor, group_size: int) -> torch.Tensor:
    """(B,) bool: the groups whose G rewards are all equal."""
    r_BG = rewards_N.view(-1, group_size)
    return (r_BG == r_BG[:, :1]).all(dim=1)
