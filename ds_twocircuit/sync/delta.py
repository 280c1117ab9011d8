"""Lossless weight deltas: send only the elements whose value, in the receiver's dtype, changed.

RL moves weights little per step (published RL fine-tuning runs: 0.03–0.13 % over a whole run), below bf16's ~0.4 %
resolution, so most bf16 values a sampler holds do not change from one step to the next. The
sender keeps the values it last sent (`old`), compares them with the new ones bit for bit (so −0.0
against 0.0 and NaN payloads count as changes: the receiver ends bitwise equal), and encodes each
tensor in the cheapest of three raw forms (e: bytes per element, n elements, m of them changed):

    dense     every value                                   1 + n·e bytes
    bitmap    one bit per element (little-endian), values   1 + ⌈n/8⌉ + m·e
    indices   int32 position of each changed one, values    1 + m·(4 + e)     (int64 past 2³¹ elements)

and, where some changed, the sparser of the last two compressed (zstd, level 1) with each changed
value XOR its old bits in place of the value (a small move flips low mantissa bits only, so the XOR
has long runs of zero bits that the compressor takes out; positions as gaps between them):

    zbitmap   zstd(bitmap ‖ XOR'd values)                   1 + compressed size
    zindices  zstd(gaps between changed positions ‖ XOR'd)  1 + compressed size    (uint32 gaps; uint64 past 2³¹)

kept only where smaller than the cheapest raw form (`compress=False`: the raw forms alone).
Measured on a real run's first six steps (launch/bench_stream.py; the 60.6 M-parameter wide model,
AdamW at 3e-5): in bf16, 31 % of the values change a step, raw 45.4 MB, zbitmap 19.6 MB (0.16 of
the whole bf16 model; zindices 25.9 MB); in fp32 every value changes, dense 242 MB, zstd 163 MB.
The whole model encodes in 1.2 s and decodes in 0.8 s on one CPU thread (raw: 0.4 and 0.4); each
stage encodes its own share, rank 0 decodes them all.

The first byte names the form. A tensor that changed everywhere costs one byte more than dense (or
less, compressed); an unchanged one costs one byte. The receiver rebuilds new = old with
new[changed] = values, exactly. `old = None` (nothing sent yet) always encodes dense.

A blob of several tensors (`encode_all`) is their encodings in order, each behind its length as
8 bytes little-endian; both ends know the tensors' names, shapes and dtype. Pure: torch and numpy, on
host tensors (the weight sync copies a stage's weights to the CPU first).
"""
from dataclasses import dataclass

import numpy as np
import torch
import zstandard

DENSE, BITMAP, INDICES, ZBITMAP, ZINDICES = 0, 1, 2, 3, 4
ZSTD_LEVEL = 1     # level 3 saved 2.5 % more at twice the time (launch/bench_stream.py)
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}   # same-width integer views


@dataclass
class DeltaStats:
    changed: int = 0        # elements whose value changed
    numel: int = 0          # elements compared
    nbytes: int = 0         # encoded bytes (what crosses the wire, length prefixes included)
    dense_bytes: int = 0    # the same tensors sent whole: Σ n·e

    def __add__(self, o: "DeltaStats") -> "DeltaStats":
        return DeltaStats(self.changed + o.changed, self.numel + o.numel, self.nbytes + o.nbytes,
                          self.dense_bytes + o.dense_bytes)


def _bits(x: torch.Tensor) -> torch.Tensor:
    """A flat integer view of x's bits (bitwise comparison)."""
    return x.detach().reshape(-1).view(_INT[x.element_size()])


def _bytes(x: torch.Tensor) -> bytes:
    return _bits(x.contiguous()).numpy().tobytes()


def _idx_width(numel: int) -> int:
    return 4 if numel < 2 ** 31 else 8


def changed_mask(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """(n,) bool: where new's bits differ from old's (same shape and dtype)."""
    assert old.shape == new.shape and old.dtype == new.dtype, (old.shape, new.shape, old.dtype, new.dtype)
    return _bits(old) != _bits(new)


def encode(old: torch.Tensor | None, new: torch.Tensor, compress: bool = True) -> tuple[bytes, int]:
    """One tensor's update → (its encoding, elements changed)."""
    n, e = new.numel(), new.element_size()
    if old is None:
        return bytes([DENSE]) + _bytes(new), n
    mask = changed_mask(old, new)
    m = int(mask.sum())
    w = _idx_width(n)
    sizes = {DENSE: n * e, BITMAP: (n + 7) // 8 + m * e, INDICES: m * (w + e)}
    form = min(sizes, key=lambda f: (sizes[f], f))
    raw = _raw(form, old, new, mask, w)
    if not compress or m == 0:
        return raw, m
    packed = _zstd(sizes[BITMAP] <= sizes[INDICES], old, new, mask, w)
    return (packed if len(packed) < len(raw) else raw), m


def _raw(form: int, old: torch.Tensor, new: torch.Tensor, mask: torch.Tensor, w: int) -> bytes:
    if form == DENSE:
        return bytes([DENSE]) + _bytes(new)
    values = _bytes(new.reshape(-1)[mask])
    if form == BITMAP:
        return bytes([BITMAP]) + np.packbits(mask.numpy(), bitorder="little").tobytes() + values
    idx = mask.nonzero().reshape(-1).to(torch.int32 if w == 4 else torch.int64)
    return bytes([INDICES]) + idx.numpy().tobytes() + values


def _zstd(bitmap: bool, old: torch.Tensor, new: torch.Tensor, mask: torch.Tensor, w: int) -> bytes:
    """zbitmap or zindices: the changed positions and each changed value XOR its old bits, compressed."""
    xor = (_bits(new)[mask] ^ _bits(old)[mask]).numpy().tobytes()
    if bitmap:
        where = np.packbits(mask.numpy(), bitorder="little").tobytes()
    else:
        pos = mask.nonzero().reshape(-1).numpy()
        where = np.diff(pos, prepend=0).astype(np.uint32 if w == 4 else np.uint64).tobytes()
    body = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(where + xor)
    return bytes([ZBITMAP if bitmap else ZINDICES]) + body


def decode(old: torch.Tensor | None, data: bytes, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """The tensor `data` encodes against `old` (a new tensor; old is not modified)."""
    n, e = int(np.prod(shape, dtype=np.int64)), torch.empty((), dtype=dtype).element_size()
    form, body = data[0], memoryview(data)[1:]
    if form == DENSE:
        if len(body) != n * e:
            raise ValueError(f"dense delta of {len(body)} bytes for {n} elements of {e} bytes")
        return _from_bytes(body, dtype).reshape(shape).clone()
    if old is None:
        raise ValueError("a sparse delta needs the values it was taken against")
    out = old.detach().reshape(-1).clone()
    if form in (ZBITMAP, ZINDICES):
        return _unzstd(form, out, body, n, e).reshape(shape)
    if form == BITMAP:
        nb = (n + 7) // 8
        mask = torch.from_numpy(np.unpackbits(np.frombuffer(body[:nb], dtype=np.uint8), count=n,
                                              bitorder="little").astype(bool))
        values = _from_bytes(body[nb:], dtype)
        if values.numel() != int(mask.sum()):
            raise ValueError(f"bitmap delta: {int(mask.sum())} changes, {values.numel()} values")
        out[mask] = values
    elif form == INDICES:
        w = _idx_width(n)
        m, rest = divmod(len(body), w + e)
        if rest:
            raise ValueError(f"indices delta of {len(body)} bytes is not a multiple of {w + e}")
        idx = torch.from_numpy(np.frombuffer(body[:m * w], dtype=np.int32 if w == 4 else np.int64).astype(np.int64))
        if m and (int(idx.min()) < 0 or int(idx.max()) >= n):
            raise ValueError(f"indices delta: position out of range for {n} elements")
        out[idx] = _from_bytes(body[m * w:], dtype)
    else:
        raise ValueError(f"unknown delta form {form}")
    return out.reshape(shape)


def _unzstd(form: int, out: torch.Tensor, body, n: int, e: int) -> torch.Tensor:
    """zbitmap's or zindices' changes applied to `out` (old's flat copy), in place; → out."""
    try:
        data = zstandard.ZstdDecompressor().decompress(bytes(body))
    except zstandard.ZstdError as err:
        raise ValueError(f"compressed delta: {err}") from None
    bits = _bits(out)
    if form == ZBITMAP:
        nb = (n + 7) // 8
        mask = torch.from_numpy(np.unpackbits(np.frombuffer(data[:nb], dtype=np.uint8), count=n,
                                              bitorder="little").astype(bool))
        xor = data[nb:]
        if len(data) < nb or len(xor) != int(mask.sum()) * e:
            raise ValueError(f"zbitmap delta: {int(mask.sum())} changes, {len(xor)} bytes of values")
        bits[mask] ^= _from_bytes(xor, out.dtype).view(bits.dtype)
        return out
    w = _idx_width(n)
    m, rest = divmod(len(data), w + e)
    if rest:
        raise ValueError(f"zindices delta of {len(data)} bytes is not a multiple of {w + e}")
    pos = torch.from_numpy(np.cumsum(np.frombuffer(data[:m * w], dtype=np.uint32 if w == 4 else np.uint64)
                                     .astype(np.int64)))
    if m and int(pos[-1]) >= n:
        raise ValueError(f"zindices delta: position out of range for {n} elements")
    bits[pos] ^= _from_bytes(data[m * w:], out.dtype).view(bits.dtype)
    return out


def _from_bytes(buf, dtype: torch.dtype) -> torch.Tensor:
    e = torch.empty((), dtype=dtype).element_size()
    if len(buf) == 0:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(bytearray(buf), dtype=_INT[e]).view(dtype)


def encode_all(olds: list[torch.Tensor | None], news: list[torch.Tensor],
               compress: bool = True) -> tuple[bytes, DeltaStats]:
    """Several tensors' updates → (one blob, its stats)."""
    parts, stats = [], DeltaStats()
    for old, new in zip(olds, news, strict=True):
        data, m = encode(old, new, compress)
        parts += [len(data).to_bytes(8, "little"), data]
        stats += DeltaStats(m, new.numel(), 8 + len(data), new.numel() * new.element_size())
    return b"".join(parts), stats


def _entries(blob: bytes):
    """(offset, size) of each tensor's encoding in a blob of `encode_all`."""
    at, view = 0, memoryview(blob)
    while at < len(blob):
        if at + 8 > len(blob):
            raise ValueError(f"delta blob truncated at byte {at} of {len(blob)}")
        size = int.from_bytes(view[at:at + 8], "little")
        if size < 1 or at + 8 + size > len(blob):
            raise ValueError(f"delta blob truncated: a tensor of {size} bytes at byte {at} of {len(blob)}")
        yield at + 8, size
        at += 8 + size


def unchanged(blob: bytes) -> list[bool]:
    """Per tensor of a blob: whether its encoding says nothing changed."""
    return [blob[at] == INDICES and size == 1 for at, size in _entries(blob)]


def decode_all(olds: list[torch.Tensor | None], blob: bytes, shapes: list[tuple],
               dtype: torch.dtype) -> list[torch.Tensor]:
    """The tensors a blob of `encode_all` encodes, against `olds` (raises ValueError on a malformed blob)."""
    entries = list(_entries(blob))
    if len(entries) != len(olds):
        raise ValueError(f"delta blob holds {len(entries)} tensors, expected {len(olds)}")
    view = memoryview(blob)
    return [decode(old, bytes(view[at:at + size]), shape, dtype)
            for old, shape, (at, size) in zip(olds, shapes, entries, strict=True)]
