"""The PRF wire protocol and the boundary codec (single process)."""
import pytest
import torch

from ds_twocircuit.codec import prf
from ds_twocircuit.codec.boundary import Codec
from ds_twocircuit.codec.geometry import cut_layers
from ds_twocircuit.codec.lowrank import top_basis


def codec(d=64, k=8, name="prf"):
    return Codec(name=name, d=d, k=k, seed=5, cuts={3})


def test_exactly_k_distinct_sorted_in_range():
    for d, k in [(1536, 77), (64, 3), (64, 64), (100, 1), (7, 5), (2, 2)]:
        keys = prf.token_keys(1, 2, 3, torch.arange(50)[:, None], torch.arange(40)[None])
        idx = prf.kept_channels(keys, d, k)
        assert idx.shape == (50, 40, k)
        assert (idx[..., 1:] > idx[..., :-1]).all() and idx.min() >= 0 and idx.max() < d
        if k == d:
            assert torch.equal(idx, torch.arange(d).expand_as(idx))


def feistel_reference(j: int, key: int, d: int) -> int:
    """π_key(j) by the protocol's text, in plain Python integers."""
    bits = max(2, (d - 1).bit_length())
    rks = [lowbias32_reference(key ^ ((i + 1) * 0x9E3779B9 & 0xFFFFFFFF)) for i in range(4)]
    while True:
        wl, wr = bits // 2, bits - bits // 2
        left, right = j >> wr, j & ((1 << wr) - 1)
        for rk in rks:
            left, right = right, left ^ (lowbias32_reference(right ^ rk) & ((1 << wl) - 1))
            wl, wr = wr, wl
        j = (left << wr) | right
        if j < d:
            return j


def test_kept_set_matches_the_protocol_text():
    keys = prf.token_keys(9, 1, 2, torch.arange(5), torch.arange(5))
    for d, k in [(1536, 77), (64, 3), (100, 10)]:
        got = prf.kept_channels(keys, d, k).tolist()
        want = [sorted(feistel_reference(j, int(h), d) for j in range(k)) for h in keys]
        assert got == want


def test_golden_vectors():
    """Protocol v1, pinned: any change here breaks compatibility between the two ends of a link."""
    keys = prf.token_keys(0, 3, 7, torch.tensor([0, 1, 2]), torch.tensor([0, 5, 1023]))
    assert keys.tolist() == GOLDEN_KEYS
    assert prf.kept_channels(keys, 1536, 77)[:, :8].tolist() == GOLDEN_1536
    assert prf.kept_channels(keys, 64, 3).tolist() == GOLDEN_64
    assert prf.mix32(torch.tensor([0, 1, 0xFFFFFFFF])).tolist() == GOLDEN_MIX


GOLDEN_MIX = [0, 2261973619, 2578835075]
GOLDEN_KEYS = [729569723, 2153235840, 3025258840]
GOLDEN_1536 = [[19, 21, 34, 68, 84, 90, 102, 108], [0, 2, 26, 39, 50, 91, 130, 176], [2, 3, 12, 13, 32, 41, 52, 53]]
GOLDEN_64 = [[3, 31, 32], [5, 15, 19], [17, 32, 41]]


def lowbias32_reference(x: int) -> int:
    """The protocol's mix in plain Python integers (what another implementation would write)."""
    M = 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x21F0AAAD) & M
    x ^= x >> 15
    x = (x * 0x735A2D97) & M
    return x ^ (x >> 15)


def test_mix32_matches_plain_integer_arithmetic():
    xs = torch.randint(0, 2**32, (2000,), generator=torch.Generator().manual_seed(0), dtype=torch.int64)
    assert prf.mix32(xs).tolist() == [lowbias32_reference(int(x)) for x in xs]


def test_independent_of_batch_layout():
    sid = torch.tensor([4, 9, 2])
    pos = torch.arange(6).expand(3, 6)
    whole = prf.kept_for(0, 5, 11, sid, pos, 64, 6)
    for i in range(3):
        alone = prf.kept_for(0, 5, 11, sid[i:i + 1], pos[i:i + 1], 64, 6)
        assert torch.equal(alone[0], whole[i])
    shifted = prf.kept_for(0, 5, 11, sid, pos + 0, 64, 6)   # a second call: deterministic
    assert torch.equal(shifted, whole)


def test_masks_fresh_per_step_and_layer():
    sid, pos = torch.arange(8), torch.arange(16).expand(8, 16)
    a = prf.kept_for(0, 3, 1, sid, pos, 64, 8)
    assert torch.equal(a, prf.kept_for(0, 3, 1, sid, pos, 64, 8))
    assert (a != prf.kept_for(0, 3, 2, sid, pos, 64, 8)).any(-1).float().mean() > 0.95
    assert (a != prf.kept_for(0, 7, 1, sid, pos, 64, 8)).any(-1).float().mean() > 0.95


def test_channel_frequency_is_uniform():
    keys = prf.token_keys(1, 2, 3, torch.arange(20000), torch.zeros(20000, dtype=torch.long))
    counts = torch.bincount(prf.kept_channels(keys, 64, 3).flatten(), minlength=64).float()
    expect = 20000 * 3 / 64
    assert ((counts - expect).abs() < 5 * (expect * (1 - 3 / 64)) ** 0.5).all()


def test_unbiased_over_steps():
    x = torch.randn(2, 3, 64)
    pos, sid = torch.arange(3).expand(2, 3), torch.arange(2)
    acc = torch.zeros_like(x)
    n = 3000
    c = codec(k=8)
    for step in range(n):
        with c.keyed(step):
            acc += c.decode(c.encode(x, pos, sid, 3), pos, sid, 3, torch.float32)
    # x̂_i = x_i·(d/k)·Bernoulli(k/d): mean x_i, variance x_i²(d/k − 1); z-scores of the n-step mean
    z = (acc / n - x) / (x.abs() * ((64 / 8 - 1) / n) ** 0.5)
    assert z.abs().max() < 5, z.abs().max()
    assert 0.7 < z.pow(2).mean() < 1.3, z.pow(2).mean()     # the variance is the exact-k one, no more
    c = codec(k=8)
    with c.counting() as n:
        y = c.encode(x, pos, sid, 3)
    assert y.shape == (2, 3, 8)
    assert (n.payload, n.dense) == (2 * 3 * 8 * 4, 2 * 3 * 64 * 4)


def test_keep_all_is_bitwise_dense():
    x = torch.randn(2, 5, 64)
    pos, sid = torch.arange(5).expand(2, 5), torch.arange(2)
    c = codec(k=64)
    assert torch.equal(c.decode(c.encode(x, pos, sid, 3), pos, sid, 3, torch.float32), x)


def test_gradient_is_the_same_k_coordinates():
    x = torch.randn(2, 4, 64, requires_grad=True)
    pos, sid = torch.arange(4).expand(2, 4), torch.arange(2)
    c = codec(k=8)
    y = c.encode(x, pos, sid, 3).detach().requires_grad_()
    g_out = torch.randn(2, 4, 64)
    (c.decode(y, pos, sid, 3, torch.float32) * g_out).sum().backward()
    idx = prf.kept_for(5, 3, 0, sid, pos, 64, 8)
    torch.testing.assert_close(y.grad, g_out.gather(-1, idx) * 8.0)


def test_bf16_payload():
    x = torch.randn(2, 3, 64)
    pos, sid = torch.arange(3).expand(2, 3), torch.arange(2)
    c = Codec(name="prf", d=64, k=8, cuts={3}, payload_dtype=torch.bfloat16)
    with c.counting() as n:
        y = c.encode(x, pos, sid, 3)
    assert y.dtype == torch.bfloat16 and n.payload == 2 * 3 * 8 * 2


def test_lowrank_projector():
    x = torch.randn(500, 64) @ torch.randn(64, 64) * 0.1
    q = top_basis(x, 8)
    torch.testing.assert_close(q.T @ q, torch.eye(8), atol=1e-5, rtol=0)
    c = Codec(name="lowrank", d=64, k=8, cuts={3})
    c.set_bases({3: q})
    with pytest.raises(ValueError, match="orthonormal"):
        c.set_bases({3: q * 2})
    with pytest.raises(ValueError, match="shape"):
        c.set_bases({3: q[:, :4]})
    xb = x[:6].view(2, 3, 64)
    pos, sid = torch.arange(3).expand(2, 3), torch.arange(2)
    out = c.decode(c.encode(xb, pos, sid, 3), pos, sid, 3, torch.float32)
    torch.testing.assert_close(out, xb @ q @ q.T)
    assert c.encode(xb, pos, sid, 4) is xb          # not a compressed cut
    with c.off():
        assert c.encode(xb, pos, sid, 3) is xb      # the codec-off switch
    assert c.encode(xb, pos, sid, 3) is not xb      # and only inside its block


def test_cut_layers():
    assert cut_layers([4, 4, 4, 4, 3, 3, 3, 3]) == [3, 7, 11, 15, 18, 21, 24]


def test_generation_through_codec_keep_all_is_dense(tiny_model):
    """The inference-time check's hooks: keep-all PRF leaves the logits bitwise dense (left padding
    and positions included); a 25 % PRF or a rank-k static basis changes them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ds_twocircuit.codec.inference import static_bases, through_codec
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model)
    tok.padding_side = "left"
    enc = tok(["12+3*4=", "7+1*1=15"], return_tensors="pt", padding=True, add_special_tokens=False)
    d, cuts = model.config.hidden_size, frozenset(range(model.config.num_hidden_layers - 1))
    with torch.no_grad():
        dense = model(**enc).logits
        with through_codec(model, Codec(name="prf", d=d, k=d, cuts=cuts)):
            assert torch.equal(model(**enc).logits, dense)
        with through_codec(model, Codec(name="prf", d=d, k=d // 4, cuts=cuts)):
            assert not torch.allclose(model(**enc).logits, dense, atol=1e-3)
        low = Codec(name="lowrank", d=d, k=4, cuts=cuts)
        low.set_bases(static_bases(model, enc, sorted(cuts), 4))
        with through_codec(model, low):
            assert not torch.allclose(model(**enc).logits, dense, atol=1e-3)
        assert torch.equal(model(**enc).logits, dense)          # hooks removed on exit


def round_trip(codec, x, pos, sid, layer=0):
    """The unshared cut, sender to receiver: codec.wire_in(codec.wire_out(x)), with autograd through both."""
    return codec.wire_in(codec.wire_out(x, pos, sid, layer), pos, sid, layer, torch.float32)


@pytest.mark.parametrize("name", ["dense", "prf", "rotated"])
def test_a_shared_prompt_crosses_once_and_its_gradient_sums_over_the_group(name):
    """Groups of G = 3 rows with equal prompt columns: the sender sends one prompt row per group.
    The receiver's prompt is the codec's round trip of the group's first row (keyed by its sample
    id), repeated over the group; its response columns are each row's own round trip. Backward: the
    sender's group's first prompt row gets the codec's VJP of the gradient summed over the group, the
    other rows none there, and each row's response columns the VJP of its own gradient. The codec's
    round trip and VJP are computed unshared, by autograd through wire_out and wire_in (dense: the
    identity; PRF: the kept channels × d/k; rotated: its forward code and its backward code)."""
    from ds_twocircuit.codec import shared_prompts
    from ds_twocircuit.codec.rotated import Budget
    B, T, d, P, G = 6, 5, 8, 3, 3
    extra = dict(fwd=Budget(d, 8, 4), bwd=Budget(d, 4, 2)) if name == "rotated" else {}
    codec = Codec(name=name, d=d, k=2, seed=1, cuts={0}, **extra)
    prompt = torch.randn(B // G, 1, P, d).expand(B // G, G, P, d).reshape(B, P, d)
    h = torch.cat([prompt, torch.randn(B, T - P, d)], 1).requires_grad_()
    pos, sid = torch.arange(T).expand(B, T), torch.arange(B)
    wire = shared_prompts.send(codec, h, pos, sid, 0, P, G)
    # one float tensor (DeepSpeed runs a stage's backward once per float it sent), one row per token:
    # the groups' prompt tokens, then every row's response columns
    assert [t.shape[0] for t in wire] == [B // G * P + B * (T - P)] * (2 if name == "rotated" else 1)
    assert sum(t.is_floating_point() for t in wire) == 1 and shared_prompts.padded_length(wire, B, P, G) == T
    out = shared_prompts.receive(codec, wire, pos, sid, 0, torch.float32, P, G)
    head = h[::G, :P].detach().requires_grad_()
    tail = h[:, P:].detach().requires_grad_()
    want_head, want_tail = round_trip(codec, head, pos[::G, :P], sid[::G]), round_trip(codec, tail, pos[:, P:], sid)
    assert torch.equal(out[:, :P], want_head.repeat_interleave(G, 0)) and torch.equal(out[:, P:], want_tail)
    if name == "dense":
        assert torch.equal(out, h.detach())
    else:   # a lossy code: one code per group, not the same for two groups
        assert not torch.equal(out[0, :P], h[0, :P]) and not torch.equal(out[0, :P], out[G, :P])
    g = torch.randn(B, T, d)
    out.backward(g)
    (want_head * g[:, :P].reshape(B // G, G, P, d).sum(1)).sum().backward()
    (want_tail * g[:, P:]).sum().backward()
    torch.testing.assert_close(h.grad[::G, :P], head.grad, rtol=1e-6, atol=1e-6)    # float order of the group sum
    for j in range(1, G):
        assert torch.equal(h.grad[j::G, :P], torch.zeros_like(head.grad))
    assert torch.equal(h.grad[:, P:], tail.grad)
