"""The weight stream's bytes and coding time, raw and compressed, on consecutive weights of a real run.

    DS_TWOCIRCUIT_DUMP_STREAM=DIR deepspeed --num_gpus 8 launch/train.py --ds-config ... train.steps=6
    python launch/bench_stream.py DIR [--dtypes float32 bfloat16]

The run writes the sampler's mirror after every sync (sync0 the start, sync n after step n). For each
consecutive pair and each dtype (the dumped values rounded to it: a bf16 stream is the trainer's
weights rounded to bf16), every tensor of the whole model is coded against its previous values
(sync/delta.py) and decoded back, checked bitwise:

    whole       every value: a stream without deltas
    raw         the cheapest raw form per tensor (dense, bitmap, indices)
    compressed  what ships: raw, or the sparser structure zstd-compressed with XOR'd values where smaller
    zbitmap, zindices   each tensor's changes in that compressed form alone (how the choice falls)

Bytes are per step, summed over the model's tensors, each behind its 8-byte length; seconds are encode
and decode of the whole model on one thread of this CPU (the stages code their own tensors in
parallel, each a share). Rank 0's own stage never crosses a wire; the bytes here include it.
"""
import argparse
import pathlib
import sys
import time

import torch
from safetensors.torch import load_file

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from ds_twocircuit.sync.delta import _idx_width, _zstd, changed_mask, decode, encode  # noqa: E402


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    view = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return torch.equal(a.reshape(-1).view(view), b.reshape(-1).view(view))


def bench_pair(a: dict, b: dict, dtype: torch.dtype) -> dict[str, float]:
    out = dict.fromkeys(["whole", "raw", "compressed", "zbitmap", "zindices", "changed", "numel", "t_raw_enc",
                         "t_raw_dec", "t_enc", "t_dec"], 0.0)
    for name in a:
        old, new = a[name].to(dtype), b[name].to(dtype)
        shape = tuple(new.shape)
        t0 = time.perf_counter()
        raw, m = encode(old, new, compress=False)
        t1 = time.perf_counter()
        assert same_bits(decode(old, raw, shape, dtype), new)
        t2 = time.perf_counter()
        packed, _ = encode(old, new)
        t3 = time.perf_counter()
        assert same_bits(decode(old, packed, shape, dtype), new)
        t4 = time.perf_counter()
        mask = changed_mask(old, new)
        for key, bitmap in (("zbitmap", True), ("zindices", False)):
            out[key] += 8 + (len(_zstd(bitmap, old, new, mask, _idx_width(new.numel()))) if m else 1)
        out["whole"] += 8 + 1 + new.numel() * new.element_size()
        out["raw"] += 8 + len(raw)
        out["compressed"] += 8 + len(packed)
        out["changed"] += m
        out["numel"] += new.numel()
        for k, dt in (("t_raw_enc", t1 - t0), ("t_raw_dec", t2 - t1), ("t_enc", t3 - t2), ("t_dec", t4 - t3)):
            out[k] += dt
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dir")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    a = ap.parse_args()
    torch.set_num_threads(1)
    files = sorted(pathlib.Path(a.dir).glob("sync*.safetensors"), key=lambda p: int(p.stem[4:]))
    print(f"{a.dir}: {len(files)} syncs; MB a step (mean over {len(files) - 1} steps), seconds on one thread\n")
    print("| dtype | changed | whole | raw | compressed | zbitmap alone | zindices alone | raw enc / dec s | "
          "compressed enc / dec s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for dt in a.dtypes:
        rows = [bench_pair(load_file(str(p)), load_file(str(q)), getattr(torch, dt)) for p, q in zip(files, files[1:])]
        mean = {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]}
        mb = lambda k: f"{mean[k] / 1e6:.2f}"
        print(f"| {dt} | {mean['changed'] / mean['numel']:.4f} | {mb('whole')} | {mb('raw')} | {mb('compressed')} | "
              f"{mb('zbitmap')} | {mb('zindices')} | {mean['t_raw_enc']:.2f} / {mean['t_raw_dec']:.2f} | "
              f"{mean['t_enc']:.2f} / {mean['t_dec']:.2f} |")


if __name__ == "__main__":
    main()
