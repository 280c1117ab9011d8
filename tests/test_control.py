"""The drift controller's law (control.py) and its config checks."""
import math

import pytest

from ds_twocircuit.config import ConfigError, ControlConfig, load_config
from ds_twocircuit.control import PROBE_KL, DriftController, next_level
from conftest import TINY


def test_law_closed_forms():
    assert next_level(0.01, 0.002, 0.002, 1.0, 1e-4, 1.0) == 0.01                     # on target: unchanged
    assert next_level(0.01, 0.003, 0.002, 1.0, 1e-4, 1.0) == pytest.approx(0.01 * math.exp(0.5))
    assert next_level(0.01, 0.001, 0.002, 2.0, 1e-4, 1.0) == pytest.approx(0.01 * math.exp(-1.0))
    assert next_level(0.01, 1.0, 0.002, 1.0, 1e-4, 1.0) == pytest.approx(0.01 * math.e)  # error clipped at +1
    assert next_level(0.01, -5.0, 0.002, 1.0, 1e-4, 1.0) == pytest.approx(0.01 / math.e)  # and at −1
    assert next_level(0.9, 1.0, 0.002, 1.0, 1e-4, 1.0) == 1.0                          # clamped
    assert next_level(2e-4, -1.0, 0.002, 1.0, 1e-4, 1.0) == 1e-4


def probe_rows(kls, every=5):
    """Rows as the trainer logs them: a probe reading on every `every`-th step only."""
    return [{"step": t + 1, **({PROBE_KL: kls[t // every]} if t % every == 0 else {})} for t in range(every * len(kls))]


def test_controller_acts_on_probe_rows_only():
    cfg = ControlConfig(enabled=True, target_slope=0.002, window=3, gain=1.0)
    c = DriftController(cfg, 0.001)
    out = [c.update(r) for r in probe_rows([0.0, 0.04, 0.08, 0.08])]   # slope 0.008/step, then flattening
    acted = [(r["step"], o) for r, o in zip(probe_rows([0.0, 0.04, 0.08, 0.08]), out) if "control/drift_slope" in o]
    assert [s for s, _ in acted] == [6, 11, 16]                        # probe steps, from the second reading
    assert acted[0][1]["control/drift_slope"] == pytest.approx(0.008)
    assert acted[0][1]["control/kl_coef_next"] == pytest.approx(0.001 * math.e)
    assert acted[2][1]["control/drift_slope"] == pytest.approx(0.004)  # window 3: 0.04, 0.08, 0.08 at 6, 11, 16
    assert c.beta == pytest.approx(0.001 * math.e ** 3)                # every error clipped at +1
    assert c.rate == pytest.approx(0.02 * math.e ** 3)


def test_dense_steps_come_evenly_at_the_rate():
    c = DriftController(ControlConfig(enabled=True, dense_rate_min=0.25, dense_rate_max=0.5), 0.001)
    assert [c.dense_next() for _ in range(8)] == [False, False, False, True] * 2
    c.rate, c.acc = 0.1, 0.0
    assert [c.dense_next() for _ in range(10)] == [False] * 9 + [True]     # 10 × 0.1 sums to 0.999…


def live_rows(cfg, kls, every=3):
    """A run's rows as the trainer logs them (dense_next before the step, update after), and its flags."""
    c, rows = DriftController(cfg, 0.001), []
    for r in probe_rows(kls, every):
        dense, beta = c.dense_next(), c.beta
        r.update({"actor/kl_coef": beta, "train/dense_step": float(dense)})
        r.update(c.update(r))
        rows.append(r)
    return rows


def test_resume_replays_the_logged_rows_or_refuses():
    cfg = ControlConfig(enabled=True, window=3, dense_rate_min=0.1, dense_rate_max=0.5)
    rows = live_rows(cfg, [0.0, 0.1, 0.3, 0.2, 0.5, 0.5])
    assert any(r["train/dense_step"] for r in rows) and len({r["actor/kl_coef"] for r in rows}) > 2
    c = DriftController(cfg, 0.001)
    assert c.replay(rows[:10], 10) == ""
    assert [c.dense_next() for _ in rows[10:11]] == [bool(rows[10]["train/dense_step"])]
    assert c.beta == rows[10]["actor/kl_coef"] and c.rate == rows[10]["control/dense_rate"]
    other = ControlConfig(enabled=True, window=3, gain=2.0, dense_rate_min=0.1, dense_rate_max=0.5)
    assert "was not run by this control.* config" in DriftController(other, 0.001).replay(rows[:10], 10)
    assert "must hold steps 1..10" in DriftController(cfg, 0.001).replay(rows[:9], 10)


@pytest.mark.parametrize("override, key", [
    (["control.enabled=true", "train.probe_every=0"], "train.probe_every"),
    (["control.enabled=true", "grpo.kl_coef=0"], "grpo.kl_coef"),
    (["control.enabled=true", "control.window=1"], "control.window"),
    (["control.enabled=true", "control.target_slope=0"], "control.target_slope"),
    (["control.enabled=true", "train.dense_every=5"], "train.dense_every"),
    (["control.enabled=true", "control.dense_rate_max=2"], "control.dense_rate_min"),
])
def test_bad_control_config_names_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(str(TINY), override, world_size=8)
