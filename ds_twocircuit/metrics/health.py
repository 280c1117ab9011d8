"""Health metrics (pure): the train-inference mismatch, its split by source, and the trend of a logged metric.

Train-inference mismatch on the sampled response tokens, sampler log-probs s vs trainer log-probs
t of the same tokens under the same weights θ_t (sampled from the sampler, so expectations are
under the sampler's distribution):

    rollout_corr/kl            = E[s − t]                        (k1 estimate of KL(sampler‖trainer))
    rollout_corr/k3_kl         = E[e^{t−s} − (t−s) − 1]          (k3, ≥ 0, lower variance)
    rollout_corr/prob_diff_mean= E[|e^s − e^t|]
    rollout_corr/logp_diff_mean= E[|s − t|]                      (0 only when every token agrees)
    rollout_corr/pearson       = corr(e^s, e^t) over the tokens
"""
import torch


MISMATCH_SUMS = ["rollout_corr/kl", "rollout_corr/k3_kl", "rollout_corr/prob_diff_mean",
                 "rollout_corr/logp_diff_mean", "rollout_corr/_ps",
                 "rollout_corr/_pt", "rollout_corr/_ps2", "rollout_corr/_pt2", "rollout_corr/_pspt"]


def mismatch_sums(sampler_logp, trainer_logp, weight) -> dict[str, torch.Tensor]:
    """Weighted sums over tokens (weights sum to 1 over the batch) → means once summed over ranks.

    The Pearson needs moments; they are returned as sums and finished by `finish_mismatch`."""
    w = weight
    d = torch.where(w > 0, trainer_logp - sampler_logp, torch.zeros_like(w))   # 0 before e^d off the response
    ps, pt = sampler_logp.exp(), trainer_logp.exp()
    return {
        "rollout_corr/kl": (w * -d).sum(),
        "rollout_corr/k3_kl": (w * (d.exp() - d - 1)).sum(),
        "rollout_corr/prob_diff_mean": (w * (ps - pt).abs()).sum(),
        "rollout_corr/logp_diff_mean": (w * d.abs()).sum(),
        "rollout_corr/_ps": (w * ps).sum(), "rollout_corr/_pt": (w * pt).sum(),
        "rollout_corr/_ps2": (w * ps * ps).sum(), "rollout_corr/_pt2": (w * pt * pt).sum(),
        "rollout_corr/_pspt": (w * ps * pt).sum(),
    }


SPLIT_SUMS = ["mismatch/numerics_kl", "mismatch/codec_kl", "mismatch/numerics_logp_diff", "mismatch/codec_logp_diff"]
STALENESS_SUMS = ["mismatch/staleness_kl", "mismatch/staleness_logp_diff"]


def mismatch_split(sampler_logp, dense_logp, trainer_logp, weight, rescored_logp=None) -> dict[str, torch.Tensor]:
    """The sampler–trainer gap by source, on the same tokens (weights summing to 1 over them once summed
    over ranks), with d the trainer's codec-off log-probs at the same weights (the probe's):

        mismatch/numerics_kl = E[s − d]      the sampler's backend and precision against the dense trainer
        mismatch/codec_kl    = E[d − t]      the codec's share: dense against the compressed pass
        numerics_kl + codec_kl = E[s − t]    rollout_corr/kl on these tokens, exactly up to rounding

    and the mean absolute differences of each pair (k1 means can cancel; these cannot). With the
    sampler ahead of the trainer (`rescored_logp` r: the sampler's log-probs of the same tokens at the
    trainer's weights θ_t, where s is at θ_{t−k}), the sampler's side splits once more:

        mismatch/staleness_kl = E[s − r]     the weights the batch was drawn from against θ_t
        mismatch/numerics_kl  = E[r − d]     then the backend and precision alone
        staleness_kl + numerics_kl + codec_kl = E[s − t]

    (r is one teacher-forced pass, s was computed a cached token at a time: on a batch drawn at θ_t
    itself, a run's first step, they differ by float summation order alone, which the staleness part
    then carries.)"""
    w = weight
    on = w > 0
    side = lambda a, b: torch.where(on, a - b, torch.zeros_like(w))
    num = side(sampler_logp if rescored_logp is None else rescored_logp, dense_logp)
    codec = side(dense_logp, trainer_logp)
    out = {"mismatch/numerics_kl": (w * num).sum(), "mismatch/codec_kl": (w * codec).sum(),
           "mismatch/numerics_logp_diff": (w * num.abs()).sum(), "mismatch/codec_logp_diff": (w * codec.abs()).sum()}
    if rescored_logp is not None:
        stale = side(sampler_logp, rescored_logp)
        out.update({"mismatch/staleness_kl": (w * stale).sum(), "mismatch/staleness_logp_diff": (w * stale.abs()).sum()})
    return out


def finish_mismatch(m: dict[str, float]) -> dict[str, float]:
    """Turn the moment sums into `rollout_corr/pearson` and drop the helper keys (others pass through)."""
    g = lambda name: m["rollout_corr/" + name]
    cov = g("_pspt") - g("_ps") * g("_pt")
    var = (g("_ps2") - g("_ps") ** 2) * (g("_pt2") - g("_pt") ** 2)
    out = {k: v for k, v in m.items() if not k.rsplit("/", 1)[-1].startswith("_")}
    out["rollout_corr/pearson"] = cov / var ** 0.5 if var > 0 else 1.0
    return out


def ls_slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope dy/dx of the points; nan with fewer than two.

        slope = Σ (x − x̄)(y − ȳ) / Σ (x − x̄)²
    """
    n = len(xs)
    if n < 2:
        return float("nan")
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else float("nan")


class Trend:
    """The running slope per step of one logged metric over its last `window` values: the gap's
    trend (`rollout_corr/kl_slope`) is what says whether a run is healthy, not the gap's level."""

    def __init__(self, key: str, window: int = 20, skip: str | None = None):
        self.key, self.window, self.skip, self.pts = key, window, skip, []

    def update(self, row: dict) -> float | None:
        """Add the row's value (if it has one and the row's `skip` flag is not set); → the slope over
        the window, None before two points."""
        if self.key in row and not (self.skip and row.get(self.skip)):
            self.pts = (self.pts + [(row["step"], row[self.key])])[-self.window:]
        if len(self.pts) < 2:
            return None
        return ls_slope([p[0] for p in self.pts], [p[1] for p in self.pts])
