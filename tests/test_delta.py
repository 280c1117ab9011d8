"""Lossless weight deltas (sync/delta.py): bitwise round trips, the form each size picks, malformed blobs."""
import math

import pytest
import torch

from ds_twocircuit.sync.delta import (BITMAP, DENSE, INDICES, ZBITMAP, ZINDICES, changed_mask, decode, decode_all,
                                      encode, encode_all, unchanged)


def moved(x: torch.Tensor, frac: float, seed: int = 0) -> torch.Tensor:
    """x with a random `frac` of its elements nudged by 1 ulp-ish in x's dtype."""
    g = torch.Generator().manual_seed(seed)
    y = x.clone()
    pick = torch.rand(x.shape, generator=g) < frac
    y[pick] = (y[pick].float() * 1.01 + 1e-3).to(x.dtype)
    return y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("frac", [0.0, 0.001, 0.05, 0.3, 1.0])
def test_round_trip_is_bitwise_and_picks_the_smallest_form(dtype, frac):
    old = torch.randn(37, 129).to(dtype)
    new = moved(old, frac)
    data, m = encode(old, new, compress=False)
    assert m == int(changed_mask(old, new).sum())
    got = decode(old, data, tuple(new.shape), dtype)
    assert torch.equal(got.view(torch.int16 if dtype != torch.float32 else torch.int32),
                       new.view(torch.int16 if dtype != torch.float32 else torch.int32))
    n, e = new.numel(), new.element_size()
    sizes = {DENSE: n * e, BITMAP: math.ceil(n / 8) + m * e, INDICES: m * (4 + e)}
    assert len(data) == 1 + min(sizes.values())
    assert data[0] == min(sizes, key=lambda f: (sizes[f], f))


def test_forms_at_their_break_even_points():
    """bf16 (e = 2): indices below 1/32 changed (m·6 < n/8 + m·2), bitmap up to 15/16, dense above;
    an unchanged tensor is one byte, one changed everywhere is dense plus one byte (raw forms: a
    random tensor's moves do not compress)."""
    old = torch.randn(4096).to(torch.bfloat16)
    assert encode(old, old.clone()) == (bytes([INDICES]), 0)
    assert encode(old, moved(old, 0.01), compress=False)[0][0] == INDICES
    assert encode(old, moved(old, 0.5), compress=False)[0][0] == BITMAP
    everywhere = (old.float() + 1000).to(torch.bfloat16)
    data, m = encode(old, everywhere, compress=False)
    assert m == 4096 and data[0] == DENSE and len(data) == 1 + 4096 * 2
    assert encode(None, old)[0] == bytes([DENSE]) + old.view(torch.int16).numpy().tobytes()


def test_signed_zero_and_nan_payloads_are_changes():
    old = torch.tensor([0.0, 1.0, float("nan"), 2.0])
    new = torch.tensor([-0.0, 1.0, float("nan"), 2.0])
    new.view(torch.int32)[2] ^= 1                          # another NaN payload
    data, m = encode(old, new)
    assert m == 2
    assert torch.equal(decode(old, data, (4,), torch.float32).view(torch.int32), new.view(torch.int32))


def test_blob_of_many_tensors_and_its_stats():
    shapes = [(5, 7), (300,), (1,), (64, 64)]
    olds = [torch.randn(s).to(torch.bfloat16) for s in shapes]
    news = [moved(o, f, i) for i, (o, f) in enumerate(zip(olds, [0.0, 0.02, 1.0, 0.4]))]
    blob, stats = encode_all(olds, news)
    assert stats.nbytes == len(blob)
    assert stats.numel == sum(math.prod(s) for s in shapes) and stats.dense_bytes == 2 * stats.numel
    assert stats.changed == sum(int(changed_mask(o, n).sum()) for o, n in zip(olds, news))
    assert unchanged(blob) == [True, False, False, False]
    got = decode_all(olds, blob, shapes, torch.bfloat16)
    assert all(torch.equal(g.view(torch.int16), n.view(torch.int16)) for g, n in zip(got, news))
    first, _ = encode_all([None] * 4, news)                # nothing sent yet: every tensor whole
    assert all(torch.equal(g, n) for g, n in zip(decode_all([None] * 4, first, shapes, torch.bfloat16), news))


def test_malformed_blobs_are_refused():
    old = [torch.randn(100)]
    blob, _ = encode_all(old, [moved(old[0], 0.01)])
    with pytest.raises(ValueError, match="truncated"):
        decode_all(old, blob[:-3], [(100,)], torch.float32)
    with pytest.raises(ValueError, match="truncated"):
        decode_all(old, blob + b"\0", [(100,)], torch.float32)
    with pytest.raises(ValueError, match="holds 2 tensors"):
        decode_all(old, blob + blob, [(100,)], torch.float32)
    with pytest.raises(ValueError, match="needs the values"):
        decode(None, encode(old[0], moved(old[0], 0.01))[0], (100,), torch.float32)
    bad = bytearray(encode(old[0], moved(old[0], 0.01), compress=False)[0])
    bad[1:5] = (10 ** 6).to_bytes(4, "little")              # an index past the end
    with pytest.raises(ValueError, match="out of range"):
        decode(old[0], bytes(bad), (100,), torch.float32)
    with pytest.raises(ValueError, match="unknown delta form"):
        decode(old[0], b"\x07", (100,), torch.float32)


def small_step(x: torch.Tensor, frac: float, seed: int = 0) -> torch.Tensor:
    """x after an optimizer-like step: a `frac` of its elements moved by a few units in the last place
    of the dtype (1 % of a value in bf16, 1e-5 in fp32)."""
    g = torch.Generator().manual_seed(seed)
    y = x.float().clone()   # float() of an fp32 tensor is the tensor itself
    pick = torch.rand(x.shape, generator=g) < frac
    size = 0.01 if x.dtype == torch.bfloat16 else 1e-5
    y[pick] += y[pick].abs() * size * torch.randn(int(pick.sum()), generator=g)
    return y.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("frac,form", [(0.005, ZINDICES), (0.3, ZBITMAP), (1.0, ZBITMAP)])
def test_small_moves_compress_and_round_trip_bitwise(dtype, frac, form):
    """Weight-like moves (a percent of each value's size) flip low bits only: the XOR'd values
    compress, so the compressed form of the sparser structure is kept, smaller than the cheapest raw
    form, and decodes to the new tensor bit for bit."""
    old = torch.randn(256, 512).to(dtype)
    new = small_step(old, frac)
    data, m = encode(old, new)
    raw, _ = encode(old, new, compress=False)
    assert data[0] == form and len(data) < len(raw) and m == int(changed_mask(old, new).sum())
    view = torch.int16 if dtype == torch.bfloat16 else torch.int32
    assert torch.equal(decode(old, data, tuple(new.shape), dtype).view(view), new.view(view))


def test_a_random_move_keeps_its_raw_form_and_bad_compressed_data_is_refused():
    """Moves to random bit patterns leave nothing to compress: the raw form ships. A compressed delta
    whose frame is corrupt, or whose contents disagree with the tensor, is refused."""
    old = torch.randn(4096).to(torch.bfloat16)
    noise = torch.randint(-2 ** 15, 2 ** 15, (4096,), dtype=torch.int16).view(torch.bfloat16)   # random bits
    unrelated = torch.where(torch.rand(4096) < 0.5, noise, old)
    data, _ = encode(old, unrelated)
    assert data[0] == BITMAP and data == encode(old, unrelated, compress=False)[0]
    new = small_step(old, 0.3)
    packed, _ = encode(old, new)
    assert packed[0] == ZBITMAP
    with pytest.raises(ValueError, match="compressed delta"):
        decode(old, packed[:1] + b"\0" * 8 + packed[9:], (4096,), torch.bfloat16)
    import zstandard
    wrong = bytes([ZBITMAP]) + zstandard.ZstdCompressor().compress(b"\xff" * 512 + b"\0" * 10)
    with pytest.raises(ValueError, match="zbitmap delta"):
        decode(old, wrong, (4096,), torch.bfloat16)
    far = bytes([ZINDICES]) + zstandard.ZstdCompressor().compress((5000).to_bytes(4, "little") + b"\0\0")
    with pytest.raises(ValueError, match="out of range"):
        decode(old, far, (4096,), torch.bfloat16)
