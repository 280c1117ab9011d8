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
