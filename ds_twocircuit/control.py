"""The drift controller: acts on the true drift the codec-off probe reads, instead of on
a fixed threshold of a codec-view number, with two levers: β of the KL term and dense steps.

The codec-view KL to the reference is inflated by the mask itself (large from step 1, says nothing
about damage), so the controller reads the probe's dense KL to the reference, `probe/actor/kl_loss`
(nats/token), every `train.probe_every` steps, and acts on its trend:

    s   = least-squares slope per step of the last `window` probe readings        (nats/token/step)
    e   = clip((s − s*) / s*, −1, 1)                                    s* = control.target_slope
    β   ← clamp(β · exp(gain · e), kl_coef_min, kl_coef_max)
    r   ← clamp(r · exp(gain · e), dense_rate_min, dense_rate_max)

A multiplicative, proportional law in log space (the adaptive KL controller of Ziegler et al. 2019
has this shape): both levers grow while the policy walks away from the reference faster than s*,
relax while it does not, and stay put at exactly s*. r is the fraction of steps run with the codec
off: a step is dense when the accumulator a ← a + r reaches 1 (then a ← a − 1), so dense steps come
evenly spaced at the current rate. Why two levers: β acts on the loss through the codec's view, which
is where the drift is invisible; a dense step is the one update that sees it (measured: notebooks/LOG.md).
The state is a function of the config and the logged rows, so a resumed run rebuilds it by
replaying metrics.jsonl, and refuses to resume when the rows were not produced by this config.
"""
import math

from .metrics.health import Trend

PROBE_KL = "probe/actor/kl_loss"


def next_level(x: float, slope: float, target: float, gain: float, lo: float, hi: float) -> float:
    """One update of a lever: its value x, the drift slope s and the target s* > 0 → the new value."""
    err = max(-1.0, min(1.0, (slope - target) / target))
    return max(lo, min(hi, x * math.exp(gain * err)))


class DriftController:
    """β and the dense-step rate over a run. Per step: `dense_next()` before it, `update(row)` after;
    `replay(rows)` does the same over a resumed run's logged rows."""

    def __init__(self, cfg, beta: float):
        self.cfg, self.beta, self.rate, self.acc = cfg, beta, cfg.dense_rate_min, 0.0
        self.trend = Trend(PROBE_KL, cfg.window)

    def dense_next(self) -> bool:
        """Whether the coming step runs with the codec off (the accumulator at the current rate)."""
        self.acc += self.rate
        if self.acc >= 1.0 - 1e-9:   # ten additions of 0.1 make 0.999…: still the tenth step
            self.acc -= 1.0
            return True
        return False

    def update(self, row: dict) -> dict:
        """→ the control/* metrics of this row; on a probe row both levers move by the law."""
        out = {"control/dense_rate": self.rate}
        slope = self.trend.update(row)
        if PROBE_KL not in row or slope is None or math.isnan(slope):
            return out
        c = self.cfg
        self.beta = next_level(self.beta, slope, c.target_slope, c.gain, c.kl_coef_min, c.kl_coef_max)
        self.rate = next_level(self.rate, slope, c.target_slope, c.gain, c.dense_rate_min, c.dense_rate_max)
        return {**out, "control/drift_slope": slope, "control/kl_coef_next": self.beta,
                "control/dense_rate_next": self.rate}

    def replay(self, rows: list[dict], start: int) -> str:
        """Rebuild the state of a run resumed after `start` steps from its logged rows, in the live
        order (dense_next, then update), checking each row's logged β, rate and dense flag against
        the rebuilt ones; → an error message ("" when the rows rebuild it exactly)."""
        if [r["step"] for r in rows] != list(range(1, start + 1)):
            return (f"--resume with control.enabled rebuilds the controller from metrics.jsonl, which must "
                    f"hold steps 1..{start}; it holds {len(rows)} rows")
        for r in rows:
            dense, beta, rate = self.dense_next(), self.beta, self.rate
            if (r.get("actor/kl_coef"), r.get("control/dense_rate"), bool(r.get("train/dense_step"))) != (beta, rate, dense):
                return (f"--resume: step {r['step']} of metrics.jsonl was not run by this control.* config "
                        f"(logged β {r.get('actor/kl_coef')}, rate {r.get('control/dense_rate')}; rebuilt {beta}, {rate})")
            self.update(r)
        return ""
