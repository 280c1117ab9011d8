"""The equivalence tests' own bounds can fail: each helper of conftest.py rejects the smallest
effect it is there to catch and accepts the float noise it was measured against."""
import pytest
import torch

from conftest import assert_clipped_norms, assert_same_weights

LR, STEPS = 3e-4, 4


def weights_pair(name: str, delta: float, at: int = 13) -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(0)
    a = {name: torch.randn(32, generator=g) * 0.02, "model.norm.weight": torch.ones(32)}
    b = {n: t.clone() for n, t in a.items()}
    b[name][at] += delta
    return a, b


@pytest.mark.parametrize("name", ["model.layers.0.self_attn.k_proj.bias", "model.layers.0.mlp.down_proj.weight"])
def test_same_weights_rejects_one_adam_step_and_accepts_float_noise(name):
    """One element stepped once more (lr) or two runs stepping it apart is caught on every tensor,
    the attention key biases included; the largest float-order difference measured (2.3e-6) passes."""
    assert_same_weights(*weights_pair(name, 2.3e-6), lr=LR, steps=STEPS)
    for delta in (LR, -LR, 2 * LR * STEPS):
        with pytest.raises(AssertionError):
            assert_same_weights(*weights_pair(name, delta), lr=LR, steps=STEPS)


def test_rows_close_rejects_a_difference_and_a_key_nobody_logged():
    from conftest import assert_rows_close
    a = [{"step": 1, "actor/pg_loss": 0.5}, {"step": 2, "actor/pg_loss": 0.25}]
    assert_rows_close(a, [dict(r) for r in a], ["actor/pg_loss"], rel_tol=1e-4)
    with pytest.raises(AssertionError):
        assert_rows_close(a, [a[0], {"step": 2, "actor/pg_loss": 0.2501}], ["actor/pg_loss"], rel_tol=1e-4)
    with pytest.raises(AssertionError, match="logged by neither"):
        assert_rows_close(a, a, ["actor/pg_loss", "actor/renamed"], rel_tol=1e-4)


def test_clipped_norms_reject_a_clip_that_does_not_scale():
    rows = [{"step": 1, "actor/grad_norm": 0.30, "actor/grad_norm_clipped": 0.05},
            {"step": 2, "actor/grad_norm": 0.04, "actor/grad_norm_clipped": 0.04}]
    assert_clipped_norms(rows, 0.05)
    with pytest.raises(AssertionError):    # not scaled
        assert_clipped_norms([{**rows[0], "actor/grad_norm_clipped": 0.30}, rows[1]], 0.05)
    with pytest.raises(AssertionError):    # scaled where it should not be
        assert_clipped_norms([rows[0], {**rows[1], "actor/grad_norm_clipped": 0.05}], 0.05)
    with pytest.raises(AssertionError):    # the clip never binds: the run proves nothing about it
        assert_clipped_norms([rows[1]], 0.05)
