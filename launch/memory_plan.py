"""Each GPU's peak on one node, from a recipe and its model's shape: the plan the trainer checks on CUDA
before launch (ds_twocircuit/config/memory.py, its formulas in that module's docstring), printed.

    python launch/memory_plan.py [--ds-config ds_configs/prf95_qwen1p5b.json] [--gpu-gib 78]
                                 [--world-size 8] [--measure [--tokens 2048]] [key=value ...]

`key=value` overrides the recipe as on the trainer's command line (`anchor.device=-1`,
`sampler.backend=hf`, ...). A recipe whose `model.path` is Qwen/Qwen2.5-Math-1.5B and not in the
local HF cache is planned from that model's config.json, written here, so the plan runs without a
download. `--measure` replaces two of the formulas' per-token costs by measurements on this CPU at
the real width, each in a fresh process, peak resident memory above the inputs:
  - one decoder layer's forward and backward over `tokens` positions, the gradient of its input only
    (what activation checkpointing recomputes and holds for one layer of one micro-batch during its
    backward; the weights' gradients are training state), per token;
  - the last stage's chunked log-probs (grpo/logprobs.py) over `tokens` positions.
The layer's cost per token grows with the measured length on this CPU (70 KiB at 1024 positions,
about 105 KiB at 2048): its sdpa materialises attention scores there, a GPU's flash kernel does not,
so the measured column is an upper bound.
"""
import argparse
import json
import resource
import pathlib
import subprocess
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from ds_twocircuit.config import ConfigError  # noqa: E402  (light: no torch)
from ds_twocircuit.config.checks import model_config  # noqa: E402
from ds_twocircuit.config.memory import GiB, MIN_FREE, Shape, placement_plan, refuse_crowded  # noqa: E402

# Qwen2.5-Math-1.5B's config.json (the recipe's model.path), so the plan runs without a download
QWEN_1P5B = {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
             "num_key_value_heads": 2, "vocab_size": 151_936, "tie_word_embeddings": True, "rope_theta": 10_000.0,
             "max_position_embeddings": 4096, "rms_norm_eps": 1e-6}


def rss_above(base: int) -> float:
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base) / GiB


def measure_layer(tokens: int) -> float:
    """GiB above the inputs for one decoder layer's forward and backward over `tokens` positions."""
    import torch
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RotaryEmbedding
    cfg = Qwen2Config(**QWEN_1P5B, torch_dtype="bfloat16")
    cfg._attn_implementation = "sdpa"
    # no parameter gradients: they are the training state's, counted apart
    layer = Qwen2DecoderLayer(cfg, 0).to(torch.bfloat16).requires_grad_(False)
    rope = Qwen2RotaryEmbedding(cfg)
    x = torch.randn(1, tokens, cfg.hidden_size, dtype=torch.bfloat16).requires_grad_()
    pos = torch.arange(tokens)[None]
    cos_sin = tuple(t.to(torch.bfloat16) for t in rope(x, pos))
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out = layer(x, attention_mask=None, position_ids=pos, position_embeddings=cos_sin)
    out = out[0] if isinstance(out, tuple) else out
    out.float().sum().backward()
    return rss_above(base)


def measure_head(tokens: int) -> float:
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from bench_logprob_memory import measure
    return measure("chunked", tokens, QWEN_1P5B["hidden_size"], QWEN_1P5B["vocab_size"], "bf16")["peak_GiB"]


def measured_gib(what: str, tokens: int) -> float:
    out = subprocess.run([sys.executable, __file__, "--one", what, str(tokens)], capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"measuring {what} failed: {out.stderr.strip().splitlines()[-1:]}")
    return float(out.stdout.strip().splitlines()[-1])


def load(path: str, overrides: list[str], world_size: int):
    """The recipe as the trainer reads it (data files unchecked); the 1.5B model's shape from the
    config.json above when the hub name is not in the local cache."""
    from ds_twocircuit.config import ConfigError, config_from_dict
    raw = json.load(open(path))
    try:
        return config_from_dict(raw, overrides, world_size, read_data=False)
    except ConfigError as e:
        if raw.get("twocircuit", {}).get("model", {}).get("path") != "Qwen/Qwen2.5-Math-1.5B" or "model.path" not in str(e):
            raise
    d = pathlib.Path(tempfile.mkdtemp())
    (d / "config.json").write_text(json.dumps({**QWEN_1P5B, "model_type": "qwen2"}))
    return config_from_dict(raw, [f"model.path={d}", *overrides], world_size, read_data=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ds-config", default="ds_configs/prf95_qwen1p5b.json")
    ap.add_argument("--gpu-gib", type=float, default=78.0, help="memory of one GPU (an 80 GB H100: about 78)")
    ap.add_argument("--world-size", type=int, default=8, help="ranks, all on this node")
    ap.add_argument("--measure", action="store_true", help="measure the layer's and the head's cost on this CPU")
    ap.add_argument("--tokens", type=int, default=2048, help="positions each CPU measurement runs over")
    ap.add_argument("--one", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help="dotted twocircuit keys, e.g. anchor.device=-1")
    a = ap.parse_args()
    if a.one:
        print((measure_layer if a.one[0] == "layer" else measure_head)(int(a.one[1])))
        return
    run = load(a.ds_config, a.overrides, a.world_size)
    shape = Shape.from_hf(model_config(run.tc.model))
    measured = {}
    if a.measure:
        measured = {"layer_bytes_per_token": measured_gib("layer", a.tokens) / a.tokens * GiB,
                    "head": measured_gib("head", a.tokens)}
        print(f"measured on this CPU at {a.tokens} tokens: one layer's forward + backward "
              f"{measured['layer_bytes_per_token'] / 1024:.1f} KiB/token, the chunked head {measured['head']:.2f} GiB")
    plan = placement_plan(run.tc, run.ds, shape, a.world_size, a.world_size, a.gpu_gib, **measured)
    print(f"{a.ds_config} {' '.join(a.overrides)}: {shape.params() / 1e6:.0f} M parameters, micro-batch "
          f"{run.ds['train_micro_batch_size_per_gpu']} x {run.tc.data.max_prompt_len + run.tc.grpo.max_new_tokens} "
          f"tokens (padded worst case); GiB\n")
    print(f"| GPU | process | parts | GiB | GPU total | fits {a.gpu_gib:.0f} GiB with {MIN_FREE * 100:.0f} % free |")
    print("|---|---|---|---|---|---|")
    for gpu, procs in plan.items():
        total = sum(p.gib for p in procs)
        for i, p in enumerate(procs):
            parts = ", ".join(f"{k} {v:.1f}" for k, v in p.parts.items())
            last = i == len(procs) - 1
            print(f"| {gpu if i == 0 else ''} | {p.name} | {parts} | {p.gib:.1f} | {f'{total:.1f}' if last else ''} | "
                  f"{('yes' if total <= (1 - MIN_FREE) * a.gpu_gib else '**no**') if last else ''} |")
    try:
        refuse_crowded(plan, a.gpu_gib)
    except ConfigError as e:
        print(f"\nthe trainer refuses this placement on a {a.gpu_gib:.0f} GiB GPU: {e}")


if __name__ == "__main__":
    main()
