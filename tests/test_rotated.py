"""The rotated, dithered low-bit codec (codec/rotated.py): protocol pinned, unbiased, lossless limit."""
import math

import pytest
import torch

from ds_twocircuit.codec import rotated as r
from ds_twocircuit.codec.prf import kept_channels, token_keys

KEYS = token_keys(1, 3, 5, torch.tensor([0, 7]), torch.tensor([2, 9]))
X = torch.linspace(-1, 1, 128).view(2, 64) ** 3


def test_golden_vectors():
    """Protocol v1's bytes for a fixed input and key: a change here is a wire-protocol change."""
    golden = {(64, 64, 4, "fwd"): ["a83c896a86879f59898ca97aa4569c76984a8a6b85889f598a7caa6b94469c76985a",
                                   "913a3ca6b5b8a9245d7ab125577986eb7872c3493b3755faa2863edaa8977905977c"],
              (64, 40, 2, "bwd"): ["5b3c5ab9995a6599a6aa5962", "913a955c19a6e955e5696a94"]}
    for (d, m, bits, direction), want in golden.items():
        code = r.encode(X, KEYS, r.Budget(d, m, bits), direction)
        assert [bytes(row.tolist()).hex() for row in code] == want


@pytest.mark.parametrize("d", [64, 96, 1536])
def test_rotation_is_orthogonal_blockwise(d):
    assert r.block_size(1536) == 512 and r.block_size(96) == 32
    x = torch.randn(5, d, dtype=torch.float64)
    s = r.signs(token_keys(0, 1, 2, torch.arange(5), torch.zeros(5, dtype=torch.long)), d)
    z = r.rotate(x, s)
    torch.testing.assert_close(z.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(r.unrotate(z, s), x)
    assert set(s.unique().tolist()) == {-1, 1}


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8, 13, 24])
def test_pack_round_trip_and_size(bits):
    q = torch.randint(0, 2 ** bits, (4, 37))
    b = r.pack(q, bits)
    assert b.dtype == torch.uint8 and b.shape == (4, math.ceil(37 * bits / 8))
    assert torch.equal(r.unpack(b, 37, bits), q)
    # the protocol's bit stream, written out: field i's bit t is stream bit i·b + t, LSB first per byte
    stream = [(int(v) >> t) & 1 for row in q for v in row for t in range(bits)]
    per_row = 37 * bits
    for n in range(4):
        bits_n = stream[n * per_row:(n + 1) * per_row] + [0] * ((-per_row) % 8)
        assert b[n].tolist() == [sum(bit << j for j, bit in enumerate(bits_n[i:i + 8])) for i in range(0, len(bits_n), 8)]


def test_bytes_per_token_and_budget_checks():
    assert r.Budget(64, 64, 4).bytes_per_token == 34 and r.Budget(64, 40, 2).bytes_per_token == 12
    assert r.Budget(1536, 1536, 4).bytes_per_token == 770
    for bad in ((64, 0, 2), (64, 65, 2), (64, 8, 0), (64, 8, 25)):
        with pytest.raises(ValueError, match="rotated codec budget"):
            r.Budget(*bad)


def test_smaller_budgets_use_a_subset_of_the_coordinates():
    """m' < m keeps a subset of the same rotated coordinates: the backward's adjoint lies on the forward's."""
    keys = token_keys(4, 2, 9, torch.arange(50), torch.arange(50))
    big, small = kept_channels(keys, 64, 40), kept_channels(keys, 64, 12)
    assert all(set(s.tolist()) <= set(b.tolist()) for s, b in zip(small, big))


@pytest.mark.parametrize("budget", [r.Budget(64, 64, 2), r.Budget(64, 40, 2), r.Budget(96, 20, 3)])
def test_unbiased_over_keys(budget):
    """The mean of n decodes of one x over fresh keys (steps) → x: every coordinate's z-score small."""
    n = 3000
    x = torch.randn(budget.d, generator=torch.Generator().manual_seed(0))
    keys = token_keys(0, 1, 0, torch.arange(n), torch.zeros(n, dtype=torch.long))   # one token per draw
    xh = r.decode(r.encode(x.expand(n, -1), keys, budget, "fwd"), keys, budget, "fwd").double()
    z = (xh.mean(0) - x) / (xh.std(0) / math.sqrt(n))
    assert z.abs().max() < 4.5 and z.abs().mean() < 1.1, z


def test_lossless_limit_and_zero_tokens():
    """All coordinates at 24 bits: the decode equals x to fp32 rounding; a zero token decodes to zeros."""
    x = torch.randn(6, 64)
    x[2] = 0
    keys = token_keys(3, 1, 4, torch.arange(6), torch.arange(6))
    xh = r.decode(r.encode(x, keys, r.Budget(64, 64, 24), "fwd"), keys, r.Budget(64, 64, 24), "fwd")
    torch.testing.assert_close(xh, x, atol=1e-5 * float(x.abs().max()), rtol=0)
    assert torch.equal(xh[2], torch.zeros(64))


def test_directions_dither_apart_and_error_shrinks_with_bits():
    b = r.Budget(64, 64, 2)
    assert not torch.equal(r.encode(X, KEYS, b, "fwd"), r.encode(X, KEYS, b, "bwd"))
    def nmse(bits):
        budget = r.Budget(64, 64, bits)
        xh = r.decode(r.encode(X, KEYS, budget, "fwd"), KEYS, budget, "fwd")
        return float(((xh - X) ** 2).mean() / (X ** 2).mean())
    nmse = [nmse(k) for k in (2, 4, 8)]
    assert nmse[0] > nmse[1] > nmse[2] and nmse[1] < 0.05, nmse


def test_subtractive_dither_error_is_uniform_over_one_step():
    """With every coordinate kept, the decode's error is the dither's alone: uniform on (−Δ/2, Δ/2)
    per rotated coordinate, so E‖x̂ − x‖² = d·Δ²/12 (stochastic rounding without the subtraction,
    also unbiased, would give about twice that)."""
    n, b = 4000, r.Budget(64, 64, 2)
    x = torch.randn(n, 64, generator=torch.Generator().manual_seed(1))
    keys = token_keys(0, 2, 1, torch.arange(n), torch.zeros(n, dtype=torch.long))
    code = r.encode(x, keys, b, "fwd")
    delta = 2 * code[:, :2].contiguous().view(torch.half).float()[:, 0] / 3
    ratio = ((r.decode(code, keys, b, "fwd") - x) ** 2).sum(-1) / (64 * delta ** 2 / 12)
    assert abs(float(ratio.mean()) - 1) < 0.03, float(ratio.mean())


# ---- at a cut: what crosses the wire (codec/boundary.py) -----------------------------------------
from ds_twocircuit.codec.boundary import Codec, wire_format  # noqa: E402


def cut_codec(fwd, bwd, d=32):
    return Codec(name="rotated", d=d, seed=5, cuts={3}, fwd=r.Budget(d, *fwd), bwd=r.Budget(d, *bwd))


@pytest.mark.parametrize("fwd, bwd, F, G", [((32, 4), (20, 2), 18, 8), ((20, 2), (20, 2), 8, 8),
                                            ((8, 2), (8, 8), 10, 10)])
def test_wire_bytes_per_direction(fwd, bwd, F, G):
    """F bytes per token forward (carrier + payload), G back (the carrier's gradient), G ≤ F."""
    c = cut_codec(fwd, bwd)
    assert wire_format(c.fwd, c.bwd) == (F, G)
    x = torch.randn(2, 5, 32, requires_grad=True)
    pos, sid = torch.arange(5).expand(2, 5), torch.tensor([0, 1])
    with c.keyed(7), c.counting() as n:
        wire = c.wire_out(x, pos, sid, 3)
        xh = c.wire_in(wire, pos, sid, 3, torch.float32)
    assert wire[0].dtype == torch.half and wire[0].shape == (2, 5, G // 2) and wire[0].requires_grad
    assert sum(w.numel() * w.element_size() for w in wire) == 2 * 5 * F == n.payload
    assert len(wire) == (2 if F > G else 1) and (len(wire) == 1 or wire[1].dtype == torch.uint8)
    with c.keyed(7):
        assert torch.equal(xh, c.decode(c.encode(x, pos, sid, 3), pos, sid, 3, torch.float32))
    # backward: the carrier's gradient is the G-byte backward code of ∂x̂, and ∂x its decode
    g = torch.randn_like(xh)
    wire[0].retain_grad()
    xh.backward(g)
    keys = token_keys(5, 3, 7, sid[:, None], pos).reshape(-1)
    code = wire[0].grad.contiguous().view(torch.uint8).reshape(10, G)
    b = c.bwd.bytes_per_token
    assert torch.equal(code[:, :b], r.encode(g.reshape(10, 32), keys, c.bwd, "bwd")) and (code[:, b:] == 0).all()
    assert torch.equal(x.grad.reshape(10, 32), r.decode(code[:, :b], keys, c.bwd, "bwd"))


def test_lossless_budgets_make_the_cut_the_identity_both_ways():
    c = cut_codec((32, 24), (32, 24))
    x = torch.randn(3, 4, 32, requires_grad=True)
    pos, sid = torch.arange(4).expand(3, 4), torch.arange(3)
    with c.keyed(1):
        xh = c.wire_in(c.wire_out(x, pos, sid, 3), pos, sid, 3, torch.float32)
    g = torch.randn_like(xh)
    xh.backward(g)
    torch.testing.assert_close(xh, x, atol=1e-5, rtol=0)
    torch.testing.assert_close(x.grad, g, atol=1e-5, rtol=0)


def test_backward_lies_on_the_forward_coordinates_and_is_unbiased():
    """Per token, the gradient sent back lives on the forward's rotated coordinates: R·∂x is zero
    outside S_f (the backward's m_b are the first m_b of the same keyed permutation). Over the keys,
    the mean ∂x is g (each of d coordinates kept with probability m_b/d, rescaled by d/m_b)."""
    n, d = 3000, 32
    c = cut_codec((24, 24), (12, 3), d)
    g = torch.randn(1, 1, d, generator=torch.Generator().manual_seed(2))
    pos, sid = torch.zeros(1, 1, dtype=torch.long), torch.tensor([0])
    got = []
    for step in range(n):                                # one token, fresh keys each step
        x = torch.zeros(1, 1, d, requires_grad=True)
        with c.keyed(step):
            c.wire_in(c.wire_out(x, pos, sid, 3), pos, sid, 3, torch.float32).backward(g)
        got.append(x.grad.view(d))
        if step < 50:
            k = token_keys(5, 3, step, sid[:, None], pos).reshape(-1)
            outside = torch.ones(d, dtype=torch.bool)
            outside[kept_channels(r.mix32(k ^ r.SUBSET), d, 24)[0]] = False
            assert r.rotate(x.grad.view(1, d), r.signs(k, d))[0, outside].abs().max() < 1e-5
    got = torch.stack(got).double()
    z = (got.mean(0) - g.view(d)) / (got.std(0) / math.sqrt(n))
    assert z.abs().max() < 4.5, z


def test_code_is_a_tokens_own_whatever_the_micro_batch():
    """Keys come from (sequence id, position), never from a row's place in the batch: the wire of a
    batch is its micro-batches' wires stacked, and so are the gradients sent back."""
    bits = lambda t: t.contiguous().view(torch.uint8)      # the fp16 carrier holds code bytes: NaN patterns too
    c = cut_codec((32, 4), (20, 2))
    x = torch.randn(4, 6, 32, requires_grad=True)
    g = torch.randn(4, 6, 32)
    pos, sid = torch.arange(6).expand(4, 6), torch.tensor([3, 0, 8, 5])
    with c.keyed(2):
        whole = c.wire_out(x, pos, sid, 3)
        c.wire_in(whole, pos, sid, 3, torch.float32).backward(g)
        grad_whole, x.grad = x.grad.clone(), None
        for rows in (slice(0, 1), slice(1, 3), slice(3, 4)):
            part = c.wire_out(x[rows], pos[rows], sid[rows], 3)
            assert all(torch.equal(bits(a), bits(b[rows])) for a, b in zip(part, whole))
            c.wire_in(part, pos[rows], sid[rows], 3, torch.float32).backward(g[rows])
    assert torch.equal(x.grad, grad_whole)
