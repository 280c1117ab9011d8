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


def test_the_batch_goes_only_where_it_is_read_and_is_counted(anchored):
    """rollout/bytes: what the ranks received of the step's batch. Every rank gets the response mask
    (float32, T − 1 targets), rewards, advantages (float32), sample ids (int64) and each row's span
    of real tokens (2 int64, the attention mask rebuilt from it): 4·T + 28 bytes a row, 7 receivers;
    only the last stage (rank 0 is the first) also gets the ids (int64) and the sampler's log-probs
    (float32): 12·T − 4 bytes a row. So 40·T + 192 bytes a row of 64, against 7·(24·T + 8) had every
    rank received the whole batch (0.33 of it at this T of about 11, 0.24 for long sequences). The
    evaluations carry each held-out prompt's score."""
    for r in rows(anchored):
        per_row = r["rollout/bytes"] / 64
        T = (per_row - 192) / 40
        assert T == int(T) and T > 2, r["rollout/bytes"]
        assert r["rollout/bytes"] == 64 * (40 * T + 192) < 0.34 * 64 * 7 * (24 * T + 8)
    for r in rows(anchored):   # the traffic ledger's count at the receivers, each kind's share of it
        shapes = r["wire/rollout_bytes"] - r["rollout/bytes"]    # + the batch's shapes, pickled, to every rank
        assert shapes % 7 == 0 and 0 < shapes < 7 * 1000
    for e in rows(anchored, "eval.jsonl"):
        assert len(e["scores"]) == e["n"] and set(e["scores"]) <= {"0", "1"}
        assert e["acc"] == e["scores"].count("1") / e["n"]
