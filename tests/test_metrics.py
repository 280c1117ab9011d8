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


def test_a_resumed_run_continues_its_wandb_run_without_the_replayed_steps(tmp_path, monkeypatch):
    """Offline wandb: the resumed logger opens the same run id, and gives wandb only the steps after
    the last one the interrupted run logged (the replayed ones are bit-identical, and wandb's steps
    only grow); metrics.jsonl gets every row again."""
    pytest.importorskip("wandb")
    from ds_twocircuit.metrics.logger import RunLogger
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    first = RunLogger(tmp_path, {}, True, "test", None)
    for t in (1, 2, 3):
        first.log({"step": t, "x": float(t)})
    first.close()
    run_id = (tmp_path / "wandb" / "run_id").read_text()
    again = RunLogger(tmp_path, {}, True, "test", 3)         # resumed from the checkpoint after step 2
    assert (tmp_path / "wandb" / "run_id").read_text() == run_id and again.wandb.id == run_id
    sent = []
    monkeypatch.setattr(again.wandb, "log", lambda row, step: sent.append(step))
    for t in (3, 4):
        again.log({"step": t, "x": float(t)})
    again.close()
    assert sent == [4] and [r["step"] for r in again.rows()] == [1, 2, 3, 4]
