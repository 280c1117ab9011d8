"""How many of a model's values change per optimizer step in the sampler's dtype, and what the
lossless delta sync (ds_twocircuit/delta.py) sends against a dense sync.

    python notebooks/delta_fraction.py --model embedded --lr 3e-5            # the embedded default
    python notebooks/delta_fraction.py --model wide --lr 1e-6 1e-5           # 1536 wide, random init

A stand-in for the trainer's own steps where GRPO cannot move the model: a random-init model
scores 0 on every response, so its advantages and gradient are 0. Here AdamW (the recipes'
settings) steps the supervised loss of the synthetic task instead; under Adam a weight moves by
about lr per step whatever the gradient's scale, which is what decides whether its bf16 value
changes. The embedded model's real GRPO runs log the same quantity (`sync/changed_frac`), which
checks the stand-in where both exist. Per step: the changed fraction in bf16 and fp32, the delta's
bytes over the dense bf16 sync's, and the estimate Σ min(1, |Δθ|/ulp_bf16(θ)) / n (a value changes
when its drift crosses a bf16 rounding boundary).
"""
import argparse
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from ds_twocircuit.config import TinyModelConfig  # noqa: E402
from ds_twocircuit.sync.delta import encode_all  # noqa: E402


def build(kind: str):
    from transformers import AutoModelForCausalLM, Qwen2ForCausalLM

    from ds_twocircuit.model.tiny import build_config, build_tokenizer, ensure_tiny_model
    tok = build_tokenizer()
    if kind == "embedded":
        return AutoModelForCausalLM.from_pretrained(ensure_tiny_model(TinyModelConfig(), 512), dtype=torch.float32), tok
    torch.manual_seed(0)
    cfg = TinyModelConfig(hidden_size=1536, num_layers=8, num_heads=12, num_kv_heads=2, warmup_steps=0)
    return Qwen2ForCausalLM(build_config(cfg, len(tok))), tok


def batches(tok, n: int, seed: int):
    """Supervised batches of the synthetic task (problem + answer + eos, loss on the answer)."""
    from ds_twocircuit.data.synthetic import synthetic_splits
    train, _ = synthetic_splits(512)
    g = torch.Generator().manual_seed(seed)
    while True:
        idx = torch.randint(len(train), (n,), generator=g).tolist()
        texts = [train[i]["problem"] + train[i]["answer"] for i in idx]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
        labels[:, :7] = -100                                # the 7-character prompt
        yield enc["input_ids"], enc["attention_mask"], labels


def ulp_bf16(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 values at |x| (8 significant bits)."""
    e = torch.floor(torch.log2(x.abs().clamp_min(1e-30)))
    return torch.pow(2.0, e - 7)


def run(kind: str, lr: float, steps: int, batch: int, wd: float) -> list[dict]:
    model, tok = build(kind)
    model.train()
    params = [p for p in model.parameters()]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=wd)
    data = batches(tok, batch, 0)
    prev16 = [p.detach().to(torch.bfloat16) for p in params]
    prev32 = [p.detach().clone() for p in params]
    out = []
    for step in range(1, steps + 1):
        ids, attn, labels = next(data)
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        now16 = [p.detach().to(torch.bfloat16) for p in params]
        blob, stats = encode_all(prev16, now16)
        n32 = sum(int((a != p.detach()).sum()) for a, p in zip(prev32, params))
        est = sum(float(torch.clamp((p.detach() - a).abs() / ulp_bf16(p.detach()), max=1).sum())
                  for a, p in zip(prev32, params))
        out.append({"step": step, "loss": loss.item(), "changed_bf16": stats.changed / stats.numel,
                    "changed_fp32": n32 / stats.numel, "estimate": est / stats.numel,
                    "delta_over_dense": stats.nbytes / stats.dense_bytes, "numel": stats.numel})
        prev16, prev32 = now16, [p.detach().clone() for p in params]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["embedded", "wide"], default="embedded")
    ap.add_argument("--lr", type=float, nargs="+", default=[3e-5])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    a = ap.parse_args()
    torch.set_num_threads(2)
    print("| model | parameters | lr | steps | changed in bf16 (mean, last 10 steps) | changed in fp32 | "
          "estimate Σ min(1, |Δθ|/ulp)/n | delta bytes / dense bf16 bytes |")
    print("|---|---|---|---|---|---|---|---|")
    for lr in a.lr:
        rows = run(a.model, lr, a.steps, a.batch, a.weight_decay)[-10:]
        mean = lambda k: sum(r[k] for r in rows) / len(rows)
        print(f"| {a.model} | {rows[0]['numel'] / 1e6:.2f} M | {lr:g} | {a.steps} | {mean('changed_bf16'):.4f} | "
              f"{mean('changed_fp32'):.4f} | {mean('estimate'):.4f} | {mean('delta_over_dense'):.4f} |", flush=True)


if __name__ == "__main__":
    main()
