"""The trend of a logged metric: least-squares slope over a window."""
import math

import pytest

from ds_twocircuit.metrics.health import Trend, ls_slope


def test_slope_closed_forms():
    assert ls_slope([0, 1, 2, 3], [1, 3, 5, 7]) == 2.0
    assert ls_slope([0, 1, 2], [4, 4, 4]) == 0.0
    assert math.isnan(ls_slope([5], [1.0]))
    assert abs(ls_slope([1, 2, 3, 4], [1, 0, 1, 0]) - (-0.2)) < 1e-12


def test_trend_windows_and_skips_rows_without_the_key():
    t = Trend("gap", window=3)
    assert t.update({"step": 1, "gap": 0.0}) is None
    assert t.update({"step": 2}) is None                     # a row without the metric adds nothing
    assert t.update({"step": 3, "gap": 2.0}) == 1.0
    t.update({"step": 4, "gap": 3.0})
    assert t.update({"step": 5, "gap": 3.0}) == 0.5          # only steps 3, 4, 5 remain


def test_trend_skips_flagged_rows():
    """The codec's gap trend leaves dense steps out: their gap is the backend's alone (~0)."""
    t = Trend("gap", window=3, skip="dense")
    t.update({"step": 1, "gap": 3.0})
    assert t.update({"step": 2, "gap": 0.0, "dense": 1.0}) is None
    assert t.update({"step": 3, "gap": 3.2, "dense": 0.0}) == pytest.approx(0.1)


def test_responses_cut_reads_the_last_steps_clip_ratios():
    from ds_twocircuit.step_log import responses_cut
    assert not responses_cut([0.9] * 4)                     # fewer than the window: no verdict yet
    assert responses_cut([0.0, 0.9, 0.9, 0.9, 0.9, 0.6])    # the last five: 0.84 of responses cut
    assert not responses_cut([0.9, 0.9, 0.5, 0.5, 0.5, 0.5, 0.5])   # exactly half is not "more than half"


class FakeWandbRun:
    """What RunLogger reads of a wandb run: a resumed online run that had logged steps 1-3."""
    def __init__(self, id, resume, **_):
        self.id, self.resumed = id, resume == "allow"
        self.starting_step = 4 if self.resumed else 0
        self.sent = []

    def log(self, row, step):
        self.sent.append(step)

    def finish(self):
        pass


def test_a_resumed_run_continues_its_online_wandb_run_without_the_replayed_steps(tmp_path, monkeypatch):
    """Online: the resumed logger opens the run id its start wrote and gives wandb only the steps from
    the run's next one (the replayed ones are bit-identical, and wandb's steps only grow);
    metrics.jsonl gets every row again. Offline: each start is its own wandb run, sent every row."""
    wandb = pytest.importorskip("wandb")
    from ds_twocircuit.metrics.logger import RunLogger
    monkeypatch.setattr(wandb, "init", lambda **kw: FakeWandbRun(**kw))
    monkeypatch.setenv("WANDB_MODE", "online")
    first = RunLogger(tmp_path, {}, True, "test", None)
    for t in (1, 2, 3):
        first.log({"step": t, "x": float(t)})
    first.close()
    run_id = (tmp_path / "wandb" / "run_id").read_text()
    again = RunLogger(tmp_path, {}, True, "test", 3)         # resumed from the checkpoint after step 2
    assert again.wandb.id == run_id and again.wandb.resumed
    for t in (3, 4):
        again.log({"step": t, "x": float(t)})
    assert again.wandb.sent == [4] and [r["step"] for r in again.rows()] == [1, 2, 3, 4]
    monkeypatch.setenv("WANDB_MODE", "offline")
    offline = RunLogger(tmp_path, {}, True, "test", 3)
    offline.log({"step": 3, "x": 3.0})
    assert offline.wandb.id != run_id and offline.wandb.sent == [3]
