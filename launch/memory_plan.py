"""The per-GPU peak of the 1.5B recipe on 8 GPUs (9 with the anchor's own), from its configs and
per-token costs measured on this CPU at the real width.

    python launch/memory_plan.py [--ds-config ds_configs/prf95_qwen1p5b.json] [--gpu-gib 78]
                                 [--tokens 2048] [--anchor-device own|shared]

Measured here, each in a fresh process at Qwen2.5-Math-1.5B's shape (hidden 1536, MLP 8960, 12 heads
over 2 KV heads, vocabulary 151 936), bf16, peak resident memory above the inputs:
  - one decoder layer's forward and backward over `tokens` positions, the gradient of its input only
    (what activation checkpointing recomputes and holds for one layer of one micro-batch during its
    backward; the weights' gradients are training state), per token;
  - the last stage's chunked log-probs (grpo/logprobs.py) over `tokens` positions.
From the configs, by arithmetic: training state 20 bytes a parameter under DeepSpeed's bf16
optimizer (bf16 weights and gradients, fp32 master weights and gradient accumulation, Adam's two
moments; ZeRO-1 has one replica per stage here, so divides nothing), each stage's checkpointed layer
inputs (bf16, one per layer per micro-batch in flight: 1F1B keeps S − s of them on stage s), vLLM's
`sampler.gpu_memory_utilization` of GPU 0, and the anchor in fp32 (weights, gradient, the base model,
M and the θ it rebuilds: 20 bytes a parameter) with its own checkpointed replay of one micro-batch.
Micro-batches are taken at their padded worst case, micro × (max_prompt_len + max_new_tokens)
tokens. Not counted: CUDA's context and allocator slack, NCCL's buffers (about 1–2 GB a process).
The layer's cost per token grows with the measured length on this CPU (70 KiB at 1024 positions,
about 105 KiB at 2048): its sdpa materialises attention scores there, a GPU's flash kernel does not,
so the recomputed layer's column is an upper bound.
"""
import argparse
import json
import resource
import subprocess
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from ds_twocircuit.config.checks import REFERENCE_STAGES, even_split  # noqa: E402  (light: no torch)

GiB = 2 ** 30
# Qwen2.5-Math-1.5B's config.json (the recipe's model.path), so the plan runs without a download
QWEN_1P5B = {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
             "num_key_value_heads": 2, "vocab_size": 151_936, "tie_word_embeddings": True, "rope_theta": 10_000.0,
             "max_position_embeddings": 4096, "rms_norm_eps": 1e-6}


def layer_params(c: dict) -> int:
    d, f, h, kv = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"], c["num_key_value_heads"]
    head = d // h
    attn = d * d + 2 * d * kv * head + d * d + d + 2 * kv * head      # q, k, v (with biases), o
    return attn + 3 * d * f + 2 * d                                     # the MLP, two norms


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


def measured(what: str, tokens: int) -> float:
    out = subprocess.run([sys.executable, __file__, "--one", what, str(tokens)], capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"measuring {what} failed: {out.stderr.strip().splitlines()[-1:]}")
    return float(out.stdout.strip().splitlines()[-1])


def plan(ds: dict, layer_gib_per_token: float, head_gib: float, gpu_gib: float, anchor_own: bool) -> list[tuple]:
    tc, c = ds["twocircuit"], QWEN_1P5B
    split = tc["model"].get("layers_per_stage") or even_split(c["num_hidden_layers"], REFERENCE_STAGES)   # as derived on 8 ranks
    S, d, V = len(split), c["hidden_size"], c["vocab_size"]
    micro = ds["train_micro_batch_size_per_gpu"]
    tokens = micro * (tc["data"]["max_prompt_len"] + tc["grpo"]["max_new_tokens"])
    per_layer, embed = layer_params(c), V * d
    rows = []
    for s, n in enumerate(split):
        params = n * per_layer + (embed if s in (0, S - 1) else 0) + (d if s == S - 1 else 0)
        state = params * 20 / GiB
        ckpt = (S - s) * n * tokens * d * 2 / GiB                 # bf16 layer inputs of the micro-batches in flight
        recompute = layer_gib_per_token * tokens
        head = head_gib if s == S - 1 else 0.0
        sampler = tc.get("sampler", {}).get("gpu_memory_utilization", 0.3) * gpu_gib if s == 0 else 0.0
        rows.append((f"GPU {s}: stage {s}" + (" + vLLM" if s == 0 else "") + (" + loss" if s == S - 1 else ""),
                     params, state, ckpt, recompute, head, sampler))
    a_params = sum(split) * per_layer + embed + d
    a_state = a_params * 20 / GiB
    a_ckpt = sum(split) * tokens * d * 4 / GiB                  # fp32, one micro-batch
    a_row = (f"GPU {S if anchor_own else 0}: the anchor", a_params, a_state, a_ckpt,
             layer_gib_per_token * 2 * tokens, head_gib * 2, 0.0)    # fp32 activations: twice bf16's
    if anchor_own:
        rows.append(a_row)
    else:
        rows[0] = (rows[0][0] + " + the anchor", rows[0][1] + a_params,
                   *[x + y for x, y in zip(rows[0][2:], a_row[2:])])
    return rows, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ds-config", default="ds_configs/prf95_qwen1p5b.json")
    ap.add_argument("--gpu-gib", type=float, default=78.0, help="usable memory of one GPU (an 80 GB H100: about 78)")
    ap.add_argument("--tokens", type=int, default=2048, help="positions each CPU measurement runs over")
    ap.add_argument("--anchor-device", choices=["own", "shared"], default="own")
    ap.add_argument("--one", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print((measure_layer if a.one[0] == "layer" else measure_head)(int(a.one[1])))
        return
    ds = json.load(open(a.ds_config))
    layer = measured("layer", a.tokens) / a.tokens
    head = measured("head", a.tokens)
    rows, tokens = plan(ds, layer, head, a.gpu_gib, a.anchor_device == "own")
    print(f"{a.ds_config}: micro-batch {tokens} tokens (padded worst case); measured on this CPU at "
          f"{a.tokens} tokens: one layer's forward + backward {layer * 2 ** 20:.1f} KiB/token, the chunked head "
          f"{head:.2f} GiB")
    print(f"| GPU | parameters | training state | checkpointed inputs | one layer recomputed | head | sampler "
          f"| total (GiB) | fits {a.gpu_gib:.0f} GiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, params, *parts in rows:
        total = sum(parts)
        print(f"| {name} | {params / 1e6:.0f} M | " + " | ".join(f"{x:.1f}" for x in parts)
              + f" | {total:.1f} | {'yes' if total < a.gpu_gib else '**no**'} |")


if __name__ == "__main__":
    main()
