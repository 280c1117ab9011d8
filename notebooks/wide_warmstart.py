"""The wide embedded model's warm start, probed: held-out greedy accuracy every `--every` steps.

    python notebooks/wide_warmstart.py --steps 1000 --every 25 --install-band 0.33 0.5

Runs the same warm start `model.embedded=wide` builds (model/tiny.py's `warm_start`, the same seed,
batches and optimizer), evaluating the held-out split at each probe, so the curve says which
`warmup_steps` lands the model in the 0.3-0.5 band with room to learn. The probes only read the
model: the weights at step N are those a build with `warmup_steps=N` writes. `--install-band LO HI`
puts the first probe's snapshot whose accuracy is in [LO, HI] into the cache as that build (keyed by
the configuration with `warmup_steps=N` and the held-out size, as `model.embedded=wide` looks it up)
and stops; N is then the `warmup_steps` default to ship.
"""
import argparse
import dataclasses
import json
import os
import pathlib
import shutil
import tempfile
import time

import torch
from transformers import Qwen2ForCausalLM

from ds_twocircuit.config import WideModelConfig
from ds_twocircuit.data.synthetic import synthetic_splits
from ds_twocircuit.data.verify import exact_integers
from ds_twocircuit.model.tiny import build_config, build_tokenizer, built_with, cache_root, tiny_model_key, warm_start
from ds_twocircuit.sampler.hf import HFSampler, greedy_accuracy


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--every", type=int, default=50)
    ap.add_argument("--install-band", type=float, nargs=2, default=None,
                    help="install the first snapshot whose held-out accuracy is in [LO, HI] and stop")
    ap.add_argument("--eval-size", type=int, default=512)
    ap.add_argument("--out", default="runs/wide_warmstart")
    ap.add_argument("overrides", nargs="*", help="WideModelConfig fields, key=value (e.g. hidden_size=256)")
    a = ap.parse_args()
    fields = {f.name: f.type for f in dataclasses.fields(WideModelConfig)}
    kw = {k: (float if fields[k] in (float, "float") else int)(v) for k, v in (o.split("=") for o in a.overrides)}
    wide = WideModelConfig(**{**kw, "warmup_steps": a.steps})
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(wide.seed)
    tok = build_tokenizer()
    model = Qwen2ForCausalLM(build_config(wide, len(tok)))
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters", flush=True)
    train, held = synthetic_splits(a.eval_size)
    t0 = time.time()

    def probe(step, loss):
        snap = out / f"step-{step}"
        model.save_pretrained(snap)
        tok.save_pretrained(snap)
        acc = greedy_accuracy(HFSampler(str(snap)), held["problem"], held["answer"], exact_integers, 5)
        row = {"step": step, "loss": loss, "held_out_acc": acc, "elapsed_s": round(time.time() - t0, 1)}
        print(json.dumps(row), flush=True)
        with open(out / "curve.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        if a.install_band and a.install_band[0] <= acc <= a.install_band[1]:
            install(snap, dataclasses.replace(wide, warmup_steps=step), a.eval_size, acc)
            raise Installed

    try:
        warm_start(model, tok, train["problem"], train["answer"], wide, probe=probe, probe_every=a.every)
    except Installed:
        pass


class Installed(Exception):
    """The probe installed a snapshot: the warm start stops there."""


def install(snap: pathlib.Path, wide: WideModelConfig, eval_size: int, acc: float) -> None:
    target = cache_root() / f"wide-{tiny_model_key(wide, eval_size)}"
    tmp = pathlib.Path(tempfile.mkdtemp(dir=cache_root(), prefix=".wide-"))
    shutil.copytree(snap, tmp, dirs_exist_ok=True)
    (tmp / "warmup.json").write_text(json.dumps({"held_out_acc": acc, **dataclasses.asdict(wide), **built_with()}))
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)
    print(f"installed {target}", flush=True)


if __name__ == "__main__":
    main()
