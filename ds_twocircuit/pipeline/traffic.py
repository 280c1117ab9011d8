"""Every byte that crosses between two hosts, counted where its transport moves it, by kind.

Each transport adds what it moved to this process's ledger at the receiving end: a rank counts the
bytes it receives, by kind and by the endpoint they came from (a rank, or the anchor process), and
rank 0 also counts what it hands the anchor. The transports and their kinds:

    boundary_update     pipeline p2p (pipeline/wire.py) in a step's training passes: activations,
                        gradients, their side tensors and shape metadata, as DeepSpeed sends them
    boundary_dense      the same on a dense step (its training passes, with the codec off)
    boundary_reference  p2p of the pipeline's reference pass (grpo.ref_logprobs = pipeline)
    boundary_probe      what the codec-off probe moves: its p2p (forward, and backward with
                        per-parameter gradients), its tied gradients' all-reduce, and the sampler's
                        rescored log-probs it compares (with the sampler ahead)
    tied_grads          DeepSpeed's all-reduce of the tied embedding's gradient between the first
                        and the last stage (model/pipe.py), in the training passes
    stream              the weight stream: each stage's deltas to rank 0 (sync/weight_sync.py)
    rollout             the step's batch from rank 0 (rollout_side.py), its shapes included
    reference           the sampler's reference log-probs from rank 0 (grpo.ref_logprobs = sampler)
    signs               sign(M) (and the lowrank bases) from rank 0 to every stage (anchor/link.py)
    anchor_theta        θ and the replayed batch handed to the anchor process (mailbox files)
    anchor_signs        the anchor's signs read back (mailbox files)

Which endpoints share a host is the placement (`host_map`): by default each stage is a host of its
own (what the product is for: stages on slow links); on a multi-node launch the launcher's node of
each rank (CROSS_RANK). The sampler lives in rank 0's process; the anchor on rank 0's host unless
`anchor.external`. A byte between endpoints of one host is counted by the ledger but not on the wire.

Each step every rank's `take` goes to rank 0 (comm.gather_to_rank0) and `summarize` turns them into
`wire/<kind>_bytes`, `wire/total_bytes` and `wire/busiest_link_bytes` (the most bytes one directed
host pair carried); `with_baseline` adds `wire/baseline_bytes`, a dense bf16 pipeline's.

Not counted yet: DeepSpeed's data-parallel gradient reduction and ZeRO's all-gathers (which cross
hosts only where a stage's replicas sit on different nodes), and a broadcast is counted once per
receiving rank, as if rank 0 sent each its own copy (NCCL's tree crosses a node boundary about once). Control-path metadata (flags, scalars, metric partials, send_bytes' length
headers excepted) is not counted: tens of bytes a step.
"""
import contextlib

import torch

KINDS = ("boundary_update", "boundary_dense", "boundary_reference", "boundary_probe", "tied_grads", "stream",
         "rollout", "reference", "signs", "anchor_theta", "anchor_signs")
BOUNDARY = tuple(k for k in KINDS if k.startswith("boundary_"))
ANCHOR = -1     # the anchor process's endpoint


class _Ledger:
    def __init__(self):
        self.received: dict[tuple[str, int], int] = {}   # (kind, from endpoint) → bytes this rank received
        self.to_anchor: dict[str, int] = {}               # kind → bytes this rank handed the anchor
        self.boundary = ["boundary_update"]               # the kind of the p2p bytes now (a stack)


_L = _Ledger()


def received(kind: str, src: int, nbytes: int) -> None:
    """This rank received `nbytes` of `kind` from endpoint `src` (a global rank, or ANCHOR)."""
    assert kind in KINDS, kind
    _L.received[kind, src] = _L.received.get((kind, src), 0) + int(nbytes)


def handed_to_anchor(kind: str, nbytes: int) -> None:
    _L.to_anchor[kind] = _L.to_anchor.get(kind, 0) + int(nbytes)


def tensor_bytes(*ts: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


@contextlib.contextmanager
def boundary(kind: str):
    """The p2p bytes received inside the block are of `kind` (one of BOUNDARY); blocks nest."""
    assert kind in BOUNDARY, kind
    _L.boundary.append(kind)
    try:
        yield
    finally:
        _L.boundary.pop()


def boundary_kind() -> str:
    return _L.boundary[-1]


def take(world: int) -> torch.Tensor:
    """This rank's ledger since the last take, cleared: (len(KINDS), world + 2) int64, column j < world
    the bytes received from rank j, column world from the anchor, column world + 1 handed to it."""
    out = torch.zeros(len(KINDS), world + 2, dtype=torch.int64)   # host: it travels on the gloo control path
    for (kind, src), n in _L.received.items():
        out[KINDS.index(kind), world if src == ANCHOR else src] += n
    for kind, n in _L.to_anchor.items():
        out[KINDS.index(kind), world + 1] += n
    _L.received, _L.to_anchor = {}, {}
    return out


def host_map(stage_of: list[int], nodes: list[int] | None, anchor_external: bool) -> list[str]:
    """The host of each endpoint: ranks 0 … W−1, then the anchor. `stage_of`: each rank's stage;
    `nodes`: each rank's node from the launcher on a multi-node launch, else None (one machine: a
    host per stage, the placement the product is for)."""
    ranks = [f"node{n}" for n in nodes] if nodes else [f"stage{s}" for s in stage_of]
    return ranks + ["anchor" if anchor_external else ranks[0]]


def summarize(ledgers: list[torch.Tensor], hosts: list[str]) -> dict[str, float]:
    """Rank 0: every rank's `take` (rank order) and the host map → the step's wire metrics."""
    world = len(ledgers)
    per_kind = {k: 0 for k in KINDS}
    links: dict[tuple[str, str], int] = {}
    for dst, ledger in enumerate(ledgers):
        for kind, row in zip(KINDS, ledger.tolist()):
            for col, n in enumerate(row):
                src, to = (dst, world) if col == world + 1 else (col, dst)
                if n and hosts[src] != hosts[to]:
                    per_kind[kind] += n
                    links[hosts[src], hosts[to]] = links.get((hosts[src], hosts[to]), 0) + n
    return {**{f"wire/{k}_bytes": float(n) for k, n in per_kind.items()},
            "wire/total_bytes": float(sum(per_kind.values())),
            "wire/busiest_link_bytes": float(max(links.values(), default=0))}


def with_baseline(wire: dict[str, float], codec: dict[str, float], act_bytes: int) -> dict[str, float]:
    """`wire` with `wire/baseline_bytes`, `wire/baseline_boundary_bytes` (its boundary term, against
    which the boundary bytes alone compare): what a dense bf16 pipeline would move with the same weight
    stream, rollout and reference: the step's cross-host boundary bytes (update, reference and dense
    passes; no probe, no anchor) at the dense size of what they carried, in bf16, plus the same
    stream, rollout and reference, and the tied gradients halved where the pipeline's activations are
    fp32 (under the bf16 optimizer they are reduced in fp32 and counted as they crossed). The dense size is the
    pipeline's own count (`codec/dense_equiv_bytes*` over `codec/bytes_*`, whole pipeline); fp32
    tensors cost half in bf16 (`act_bytes`: 4 for an fp32 pipeline, 2 for a bf16 one), metadata
    scaled alike (a few hundred bytes a pass)."""
    sent = codec["codec/bytes_fwd"] + codec["codec/bytes_bwd"]
    dense = codec["codec/dense_equiv_bytes"] + codec["codec/dense_equiv_bytes_bwd"]
    half = 2 / act_bytes
    boundary = sum(wire[f"wire/{k}_bytes"] for k in ("boundary_update", "boundary_reference", "boundary_dense"))
    same = sum(wire[f"wire/{k}_bytes"] for k in ("stream", "rollout", "reference"))
    dense_bf16 = boundary * (dense / sent if sent else 1.0) * half
    return {**wire, "wire/baseline_boundary_bytes": dense_bf16,
            "wire/baseline_bytes": dense_bf16 + wire["wire/tied_grads_bytes"] * half + same}
