"""Every collective the project issues goes where a GPU machine's backends take it.

The `anchored` reference run (8 ranks: PRF cuts, the anchor process in sync mode, the drift
controller's dense steps and β, probe steps, the bf16 sampler's delta sync, checkpoints, the
export) records every torch.distributed call of every process, the anchor's included
(pipeline/comm.py's test hook). On a GPU machine the default group and DeepSpeed's groups are
NCCL, which refuses CPU tensors; the control path's group is gloo, whose p2p refuses CUDA ones.
"""
import collections
import json

from conftest import rows


def recorded(run_dir):
    """→ [(this process's device, its calls)] per process of `run_dir/collectives`."""
    out = []
    for f in sorted((run_dir / "collectives").glob("*.jsonl")):
        head, *calls = [json.loads(l) for l in f.read_text().splitlines()]
        out.append((head["device"], calls))
    return out


def test_every_project_collective_goes_through_the_control_plane_on_a_backend_that_takes_it(anchored):
    procs = recorded(anchored)
    assert len(procs) == 9, len(procs)                        # 8 trainer ranks and the anchor's process
    ours = collections.Counter()
    for device, calls in procs:
        for c in calls:
            if c["caller"] == "deepspeed":
                continue
            where = (c["op"], c["caller"], "control" if c["control"] else c["backend"])
            # one transport: nothing of ours calls torch.distributed but the control plane
            assert c["caller"] == "ds_twocircuit/pipeline/comm.py", c
            if c["control"]:
                assert c["backend"] == "gloo" and set(c["devices"]) <= {"cpu"}, c
            else:                                             # NCCL on a GPU machine: the rank's device only
                assert set(c["devices"]) == {device}, (c, device)
            ours[where] += 1
    kinds = {(op, path) for op, _, path in ours}
    # the step's traffic is all there: the rollout and the reference log-probs (device broadcasts), the
    # clip's norm (all-reduce on the pipe group), metrics (gather), the guard's flags and β, the deltas
    # and sign bits (p2p: header on the control path, bytes on the device path), checkpoint barriers
    for want in [("broadcast", "gloo"), ("broadcast", "control"), ("all_reduce", "gloo"), ("all_reduce", "control"),
                 ("gather", "control"), ("send", "control"), ("send", "gloo"), ("recv", "control"),
                 ("recv", "gloo"), ("barrier", "control"), ("broadcast_object_list", "control")]:
        assert want in kinds, (want, sorted(kinds))
    assert len(rows(anchored)) == 12


def test_the_step_counts_the_rollout_it_broadcasts(anchored):
    """rollout/bytes: one copy of the batch rank 0 broadcasts, 64 rows of (ids and attention int64,
    response mask and sampler log-probs float32 over T − 1 targets, reward and advantage float32,
    sample id int64): 24·T + 8 bytes a row."""
    for r in rows(anchored):
        per_row = r["rollout/bytes"] / 64
        assert per_row > 0 and (per_row - 8) % 24 == 0, r["rollout/bytes"]
