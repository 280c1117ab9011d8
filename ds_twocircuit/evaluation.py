"""The evaluation protocol of the math-reasoning RL literature: greedy mean@1 and avg@k at a temperature.

For P problems and k samples each, with hits h[p, j] ∈ {0, 1} (sample j of problem p correct):

    avg@k      = (1 / P·k) Σ_p Σ_j h[p, j]          (the expected mean@1 of one sampled pass)
    spread     = std_j ( (1 / P) Σ_p h[p, j] )       (how much one sampled pass's accuracy moves;
                                                     population std over the k passes)
    pass@k     = (1 / P) Σ_p max_j h[p, j]

Competition sets are small (AIME: 30 problems), so one sampled pass is noisy; published results quote
avg@k with k = 16 or 32 there, and greedy mean@1 on the larger sets.
"""
import torch


def avg_at_k(hits_PK: torch.Tensor) -> dict[str, float]:
    """hits_PK: (P, k) of 0/1 → avg@k, its spread over the k passes, pass@k."""
    per_pass_K = hits_PK.float().mean(0)
    return {"avg@k": float(per_pass_K.mean()), "spread": float(per_pass_K.std(correction=0)),
            "pass@k": float(hits_PK.amax(1).float().mean())}


def hits(sampler, prompts: list[str], answers: list[str], score, n: int, *, greedy: bool, max_new_tokens: int,
         temperature: float = 1.0, seed: int = 0, batch: int = 256) -> torch.Tensor:
    """(P, n) rewards of n generations per prompt (adjacent in the sampler's output)."""
    out = []
    for i in range(0, len(prompts), batch):
        gen = sampler.generate(prompts[i:i + batch], n, greedy=greedy, max_new_tokens=max_new_tokens,
                               temperature=temperature, seed=seed + i)
        part = answers[i:i + batch]
        out.append(torch.tensor(score(gen.texts, [part[j // n] for j in range(len(gen.texts))])).view(-1, n))
    return torch.cat(out)
