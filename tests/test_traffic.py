"""The traffic ledger's arithmetic (pipeline/traffic.py): which bytes cross between hosts, the
busiest link, the dense bf16 baseline. The counts themselves are checked at the transports of real
launches (test_control_plane.py, test_multihost.py)."""
import pytest

from ds_twocircuit.pipeline import traffic


def ledger_of(world: int, entries: dict) -> "torch.Tensor":
    """A rank's `take` from {(kind, src): bytes}; src "to_anchor" for what it handed the anchor."""
    for (kind, src), n in entries.items():
        if src == "to_anchor":
            traffic.handed_to_anchor(kind, n)
        else:
            traffic.received(kind, src, n)
    return traffic.take(world)


def test_only_bytes_between_hosts_count():
    """4 ranks, stages 0,0,1,1 (two replicas each) on one machine: a host per stage, so bytes between
    the replicas of a stage stay home; the managed anchor shares rank 0's host, an external one not."""
    hosts = traffic.host_map([0, 0, 1, 1], None, anchor_external=False)
    assert hosts == ["stage0", "stage0", "stage1", "stage1", "stage0"]
    ledgers = [ledger_of(4, {("anchor_theta", "to_anchor"): 500, ("anchor_signs", traffic.ANCHOR): 50}),
               ledger_of(4, {("rollout", 0): 7}),
               ledger_of(4, {("boundary_update", 0): 100, ("rollout", 0): 7, ("stream", 3): 3}),
               ledger_of(4, {("boundary_update", 1): 100, ("rollout", 0): 7})]
    w = traffic.summarize(ledgers, hosts)
    assert (w["wire/boundary_update_bytes"], w["wire/rollout_bytes"], w["wire/stream_bytes"]) == (200, 14, 0)
    assert w["wire/anchor_theta_bytes"] == w["wire/anchor_signs_bytes"] == 0
    assert w["wire/total_bytes"] == 214 and w["wire/busiest_link_bytes"] == 214   # stage0 → stage1
    far = traffic.summarize(ledgers, traffic.host_map([0, 0, 1, 1], None, anchor_external=True))
    assert (far["wire/anchor_theta_bytes"], far["wire/anchor_signs_bytes"], far["wire/busiest_link_bytes"]) == (500, 50, 500)
    nodes = traffic.summarize(ledgers, traffic.host_map([0, 0, 1, 1], [0, 0, 0, 0], anchor_external=False))
    assert nodes["wire/total_bytes"] == 0                                        # one node: nothing crosses


def test_the_baseline_is_dense_bf16_boundaries_and_the_same_stream():
    """A codec sending a tenth of the dense bytes in an fp32 pipeline: the baseline is the boundary
    bytes at ten times, halved for bf16, plus the stream, rollout and reference as they are and the
    tied gradients halved; the probe, the signs and the anchor are not in it."""
    wire = {f"wire/{k}_bytes": 0.0 for k in traffic.KINDS}
    wire.update({"wire/boundary_update_bytes": 90.0, "wire/boundary_reference_bytes": 10.0,
                 "wire/boundary_probe_bytes": 1e6, "wire/signs_bytes": 1e6, "wire/stream_bytes": 400.0,
                 "wire/rollout_bytes": 30.0, "wire/tied_grads_bytes": 8.0})
    codec = {"codec/bytes_fwd": 70.0, "codec/bytes_bwd": 30.0, "codec/dense_equiv_bytes": 700.0,
             "codec/dense_equiv_bytes_bwd": 300.0}
    assert traffic.with_baseline(wire, codec, 4)["wire/baseline_bytes"] == pytest.approx(500 + 4 + 430)
    assert traffic.with_baseline(wire, codec, 4)["wire/baseline_boundary_bytes"] == pytest.approx(500)
    assert traffic.with_baseline(wire, codec, 2)["wire/baseline_bytes"] == pytest.approx(1000 + 8 + 430)
