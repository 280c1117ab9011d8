"""The step's record on rank 0: the metrics row goes to the logger, after the readers of the logged
rows (the gap's trends and the drift controller) have added theirs; evaluations and notes go with it.

Rank 0 holds a `StepLog`; every other rank holds its do-nothing twin `NoStepLog`, with the same
methods, so that the trainer calls them on every rank. The drift controller decides on rank 0; the
trainer broadcasts its decisions (`dense_next`, `beta`), which the twin answers neutrally.
"""
import collections
import math
import pathlib

from tqdm import tqdm

from .config import RunConfig, as_dict, write_run_config
from .control import DriftController
from .metrics.logger import RunLogger
from .metrics.health import Trend


class StepLog:
    writes = True

    def __init__(self, run: RunConfig, run_dir: pathlib.Path, start: int, resume: bool):
        """The run directory and its config, the logger, the trends and the controller, both continued
        from the logged rows on resume (`control_error`: why the controller could not be, else "")."""
        tc = run.tc
        run_dir.mkdir(parents=True, exist_ok=True)
        write_run_config(run, run_dir)
        self.logger = RunLogger(run_dir, {"twocircuit": as_dict(tc), **run.ds}, tc.log.wandb, tc.log.project,
                                start + 1 if resume else None)
        # a dense step's gap is the backend's alone: the codec's gap trend skips it
        self.trends = {"rollout_corr/kl_slope": Trend("rollout_corr/kl", skip="train/dense_step"),
                       "probe/kl_slope": Trend("probe/actor/kl_loss")}
        self.control = DriftController(tc.control, tc.grpo.kl_coef) if tc.control.enabled else None
        logged = self.logger.rows()
        for old in logged:   # a resumed run continues its windows (and the controller)
            for t in self.trends.values():
                t.update(old)
        self.control_error = self.control.replay(logged, start) if self.control else ""
        self.max_new_tokens = tc.grpo.max_new_tokens
        self.clipped = collections.deque(maxlen=CUT_WINDOW)   # the last steps' response_length/clip_ratio
        self.warned_cut = False
        evals = self.logger.rows("eval.jsonl")      # a resumed run's earlier evaluations
        self.last = {"reward": None, "held-out": evals[-1]["acc"] if evals else None}

    def record(self, row: dict) -> None:
        """The step's row, with its trends' slopes and the controller's outputs, to metrics.jsonl."""
        for key, trend in self.trends.items():
            slope = trend.update(row)
            if slope is not None:
                row[key] = slope
        if self.control:
            row.update(self.control.update(row))
        self.logger.log(row)
        self.last["reward"] = row.get("critic/score/mean")
        self.clipped.append(row.get("response_length/clip_ratio", 0.0))
        if not self.warned_cut and responses_cut(self.clipped):
            self.warned_cut = True
            self.note(f"[warn] responses are being cut: {sum(self.clipped) / len(self.clipped):.0%} of the last "
                      f"{len(self.clipped)} steps' responses stopped at grpo.max_new_tokens={self.max_new_tokens} "
                      "without ending; raise grpo.max_new_tokens")

    def postfix(self) -> str:
        """The progress bar's postfix: the last step's mean reward and the last held-out accuracy."""
        return ", ".join(f"{k} {v:.3f}" for k, v in self.last.items() if v is not None)

    def evaluation(self, step: int, result: dict) -> None:
        self.logger.log({"step": step, **result}, file="eval.jsonl")
        self.last["held-out"] = result["acc"]
        tqdm.write(f"[eval] step {step}: held-out greedy accuracy {result['acc']:.3f} (n={result['n']})")

    def note(self, text: str) -> None:
        tqdm.write(text)

    def dense_next(self) -> bool:
        """The controller's call: run the next step dense."""
        return bool(self.control and self.control.dense_next())

    def beta(self) -> float:
        """The controller's β; NaN when it could not be rebuilt (every rank then stops)."""
        return self.control.beta if self.control and not self.control_error else math.nan

    def close(self) -> None:
        self.logger.close()


CUT_WINDOW, CUT_SHARE = 5, 0.5


def responses_cut(clip_ratios, window: int = CUT_WINDOW, share: float = CUT_SHARE) -> bool:
    """Whether more than `share` of the responses of the last `window` steps hit the length limit
    (response_length/clip_ratio, averaged): rewards then score truncated answers."""
    return len(clip_ratios) >= window and sum(list(clip_ratios)[-window:]) / window > share


class NoStepLog:
    """StepLog's twin on the ranks that log nothing."""
    writes = False
    control_error = ""

    def record(self, row: dict) -> None:
        pass

    def evaluation(self, step: int, result: dict | None) -> None:
        pass

    def note(self, text: str) -> None:
        pass

    def postfix(self) -> str:
        return ""

    def dense_next(self) -> bool:
        return False

    def beta(self) -> float:
        return math.nan

    def close(self) -> None:
        pass
