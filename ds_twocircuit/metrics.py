"""Health metrics (pure) and the run's logger (JSONL always, wandb offline unless logged in).

Train-inference mismatch on the sampled response tokens, sampler log-probs s vs trainer log-probs
t of the same tokens under the same weights θ_t (sampled from the sampler, so expectations are
under the sampler's distribution):

    rollout_corr/kl            = E[s − t]                        (k1 estimate of KL(sampler‖trainer))
    rollout_corr/k3_kl         = E[e^{t−s} − (t−s) − 1]          (k3, ≥ 0, lower variance)
    rollout_corr/prob_diff_mean= E[|e^s − e^t|]
    rollout_corr/pearson       = corr(e^s, e^t) over the tokens
"""
import json
import os
import pathlib

import torch


def mismatch_sums(sampler_logp, trainer_logp, weight) -> dict[str, torch.Tensor]:
    """Weighted sums over tokens (weights sum to 1 over the batch) → means after an all-reduce.

    The Pearson needs moments; they are returned as sums and finished by `finish_mismatch`."""
    d = trainer_logp - sampler_logp
    ps, pt = sampler_logp.exp(), trainer_logp.exp()
    w = weight
    return {
        "rollout_corr/kl": (w * -d).sum(),
        "rollout_corr/k3_kl": (w * (d.exp() - d - 1)).sum(),
        "rollout_corr/prob_diff_mean": (w * (ps - pt).abs()).sum(),
        "_ps": (w * ps).sum(), "_pt": (w * pt).sum(), "_ps2": (w * ps * ps).sum(),
        "_pt2": (w * pt * pt).sum(), "_pspt": (w * ps * pt).sum(),
    }


def finish_mismatch(m: dict[str, float]) -> dict[str, float]:
    """Turn the moment sums into `rollout_corr/pearson` and drop the helper keys."""
    cov = m["_pspt"] - m["_ps"] * m["_pt"]
    var = (m["_ps2"] - m["_ps"] ** 2) * (m["_pt2"] - m["_pt"] ** 2)
    out = {k: v for k, v in m.items() if not k.startswith("_")}
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


class RunLogger:
    """One flat namespaced dict per step → metrics.jsonl (+ wandb). Rank 0 only; others get `None`."""

    def __init__(self, run_dir: pathlib.Path, config: dict, use_wandb: bool, project: str, resume_step: int | None):
        self.run_dir = run_dir
        for name in ("metrics.jsonl", "eval.jsonl"):
            _truncate_after(run_dir / name, resume_step)
        self.wandb = _start_wandb(run_dir, config, project) if use_wandb else None

    def log(self, row: dict, file: str = "metrics.jsonl") -> None:
        with open(self.run_dir / file, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.wandb is not None:
            self.wandb.log({(f"eval/{k}" if file == "eval.jsonl" and k != "step" else k): v
                            for k, v in row.items()}, step=row["step"])

    def rows(self, file: str = "metrics.jsonl") -> list[dict]:
        path = self.run_dir / file
        return [json.loads(l) for l in path.read_text().splitlines() if l.strip()] if path.exists() else []

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()


def _truncate_after(path: pathlib.Path, resume_step: int | None) -> None:
    """On resume keep only rows of steps before the resumed step (they will be written again)."""
    if resume_step is None or not path.exists():
        if resume_step is None and path.exists():
            path.unlink()
        return
    rows = [l for l in path.read_text().splitlines() if l.strip() and json.loads(l)["step"] < resume_step]
    path.write_text("".join(r + "\n" for r in rows))


def _start_wandb(run_dir: pathlib.Path, config: dict, project: str):
    import wandb
    mode = os.environ.get("WANDB_MODE")
    if mode is None:
        mode = "online" if wandb.api.api_key else "offline"
    return wandb.init(project=project, dir=str(run_dir), config=config, mode=mode, name=run_dir.name)
