"""The optimizer step's order (pipeline/step_order.py): one pre-hook runs clip → norm → compare → correct → compare,
each on the gradient the one before left, and then the optimizer steps from the last one's."""
import pytest
import torch

from ds_twocircuit.pipeline.step_order import STEP_ORDER, install_step_hooks


def test_hooks_run_in_the_stated_order_on_each_others_gradient():
    w = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    opt = torch.optim.SGD([w], lr=1.0)
    seen = []

    def hook(name, change=None):
        def run():
            seen.append((name, w.grad.clone()))
            if change:
                w.grad.copy_(change(w.grad))
        return run

    # given in reverse: the order is STEP_ORDER's, not the dict's
    hooks = {"compare_after": hook("compare_after"), "correct": hook("correct", lambda g: g.abs()),
             "compare_before": hook("compare_before"), "stepped_norm": hook("stepped_norm"),
             "clip": hook("clip", lambda g: g / 2)}
    assert install_step_hooks(opt, hooks) == STEP_ORDER
    w.grad = torch.tensor([4.0, -6.0])
    opt.step()
    assert [n for n, _ in seen] == list(STEP_ORDER)
    grads = dict(seen)
    assert torch.equal(grads["stepped_norm"], torch.tensor([2.0, -3.0]))      # after the clip
    assert torch.equal(grads["compare_before"], torch.tensor([2.0, -3.0]))
    assert torch.equal(grads["compare_after"], torch.tensor([2.0, 3.0]))      # after the correction
    assert torch.equal(w.detach(), torch.tensor([-1.0, -5.0]))                # stepped from the last gradient


def test_absent_hooks_are_left_out_and_unknown_ones_refused():
    w = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([w], lr=1.0)
    calls = []
    assert install_step_hooks(opt, {"compare_after": lambda: calls.append("a"),
                                    "compare_before": lambda: calls.append("b")}) == ("compare_before", "compare_after")
    w.grad = torch.ones(1)
    opt.step()
    assert calls == ["b", "a"]
    with pytest.raises(ValueError, match="unknown optimizer step hook"):
        install_step_hooks(opt, {"clip_again": lambda: None})
