"""A group's prompt crosses each cut once (`grpo.share_prompts`).

The G samples of a prompt share their first P columns (the left-padded prompt; the batch's padded
prompt width), and under causal attention their hidden states there are the same at every layer.
So at a cut the sender splits its (B, T, d) hidden state into

    prompt_bPD = h[::G, :P]      one row per group (b = B/G): keyed by the group's first sample id
    resp_BRD   = h[:, P:]        every sample's own columns (R = T − P)

and codes each with the codec (`Codec.wire_out`); the receiver decodes both and rebuilds
h = [repeat_interleave(prompt, G) | resp]. Autograd does the rest: the repeat's backward sums the G
samples' prompt gradients, and that sum is what crosses back, once per group. The sender's other
G − 1 prompt rows get no gradient from the cut, which is exact because their forward values are
those of the first row (so Σ_i xᵢᵀgᵢ = x₀ᵀ Σ_i gᵢ), up to float summation order.

The two parts cross as one tensor per kind, token rows stacked: (b·P + B·R, w), the groups' prompt
tokens first. DeepSpeed 0.19.8 runs a stage's backward once per float tensor it sent
(`out.backward(gradient=g, retain_graph=True)` in turn) and accumulates the input gradients of the
passes by addition; two float tensors would run the stage's backward twice and add the two partial
gradients of every received tensor, which for the rotated codec are backward codes (bit patterns in
fp16), not numbers. One float tensor, split and joined by split/cat (whose backwards copy, never
add), keeps one backward per stage and every code intact.

With a codec on, a shared prompt is one code for the whole group: its noise is common to the
group's samples instead of independent. Requires the G samples of a group to be adjacent and in one
micro-batch (train_micro_batch_size_per_gpu a multiple of G). What crosses: the float part (dense
or PRF values, the rotated codec's fp16 carrier), then the rotated codec's uint8 payload where it has
one; DeepSpeed sends a gradient back for the float one.
"""
import torch


def send(codec, h_BTD, pos_BT, sid_B, layer: int, P: int, G: int) -> tuple:
    """The sender's side of a cut with the prompt shared: the tensors DeepSpeed sends, each (b·P + B·R, w)
    (the float part, and the rotated codec's uint8 payload)."""
    head = codec.wire_out(h_BTD[::G, :P], pos_BT[::G, :P], sid_B[::G], layer)
    tail = codec.wire_out(h_BTD[:, P:], pos_BT[:, P:], sid_B, layer)
    return tuple(torch.cat([a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])]) for a, b in zip(head, tail))


def receive(codec, wire: tuple, pos_BT, sid_B, layer: int, dtype, P: int, G: int) -> torch.Tensor:
    """The receiver's side: the decoded (B, T, d) hidden state, the prompt repeated over its group."""
    B, T = pos_BT.shape
    parts = [t.split([B // G * P, B * (T - P)]) for t in wire]
    head = codec.wire_in(tuple(h.view(B // G, P, -1) for h, _ in parts), pos_BT[::G, :P], sid_B[::G], layer, dtype)
    tail = codec.wire_in(tuple(r.view(B, T - P, -1) for _, r in parts), pos_BT[:, P:], sid_B, layer, dtype)
    return torch.cat([head.repeat_interleave(G, dim=0), tail], dim=1)


def padded_length(wire: tuple, B: int, P: int, G: int) -> int:
    """T of a shared cut's wire (b·P + B·R token rows): P + R."""
    return P + (wire[0].shape[0] - B // G * P) // B


def prompt_columns(resp_NT1: torch.Tensor) -> int:
    """P: the columns before the first response token (target column j scores ids[:, j+1]); 0 for a
    batch without responses (nothing to share)."""
    cols = torch.nonzero(resp_NT1.sum(0)).flatten()
    return int(cols.min()) + 1 if len(cols) else 0


def check_groups(ids_BT: torch.Tensor, P: int, G: int) -> None:
    """Raise unless every group's G rows hold the same first P columns."""
    g = ids_BT[:, :P].view(-1, G, P)
    if not torch.equal(g, g[:, :1].expand_as(g)):
        raise ValueError(f"grpo.share_prompts: a group of {G} adjacent rows differs in its first {P} (prompt) "
                         "columns; the samples of a prompt must be adjacent and in one micro-batch")
