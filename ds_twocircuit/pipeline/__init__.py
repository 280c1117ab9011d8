"""The DeepSpeed pipeline a process runs, and what touches it.

engine.py builds it (process group, PipelineModule, DeepSpeed's engine, the codec its cuts read);
passes.py runs its passes (log-probs, updates, the dense gradient without an optimizer step);
step_order.py, clip.py, grads.py and guard.py are the optimizer step (its order, the true-norm clip,
the gradient views and comparison, the non-finite guard); wire.py is the one hook on DeepSpeed's
p2p send and receive (the bytes between stages; the tests' check that both ends agree in dtype and
count); recv_buffers.py gives every receive buffer the sender's dtype; comm.py carries every
collective of ours outside DeepSpeed's schedule (host data on a gloo group, payloads on the device);
calibration.py reads what crosses the cuts (the lowrank codec's first bases).

Importing the package asserts the installed DeepSpeed is the release it was tested with
(TESTED_DEEPSPEED, pinned in pyproject.toml): the modules here drive DeepSpeed's private pipeline
methods, which another release may change without notice, so another version fails at import
with one line, not later with a wrong gradient or an AttributeError deep in a step.
"""
import deepspeed

TESTED_DEEPSPEED = "0.19.8"


class DeepSpeedVersionError(ImportError):
    """The installed DeepSpeed is not TESTED_DEEPSPEED; the message is one line."""
    label = "deepspeed version error"      # how an entry point's one line starts


def check_deepspeed_version(found: str, tested: str = TESTED_DEEPSPEED) -> None:
    """Raise DeepSpeedVersionError unless `found` is `tested`. A local build label (`0.19.8+abc1234`,
    a build from source) counts as its release, as pip's `deepspeed==0.19.8` does."""
    if found.split("+", 1)[0] != tested:
        raise DeepSpeedVersionError(
            f"DeepSpeed {found} is installed but ds_twocircuit is tested with {tested} only: it drives "
            "DeepSpeed's private pipeline methods (PipelineEngine._exec_schedule, _train_schedule, _compute_loss, "
            "the p2p send and receive, the receive-buffer pool, the optimizer's step), which change between "
            "releases; install the tested one: "
            f"pip install deepspeed=={tested}")


check_deepspeed_version(deepspeed.__version__)
