"""Launched by test_pipeline.py under `deepspeed --num_gpus N`: pipeline logits vs the HF model.

Two batches of different lengths (the activation shape is reset between them, as the trainer does
between steps), with left- and right-padded rows. The
last stage compares against `AutoModelForCausalLM` on the same ids, mask and positions and writes
the largest absolute difference over real tokens to OUT.
"""
import json
import sys

import deepspeed
import torch
import torch.distributed as dist

from ds_twocircuit.pipeline.engine import init_distributed
from ds_twocircuit.model.pipe import TwoCircuitPipe, positions_from_mask


def batches():
    g = torch.Generator().manual_seed(0)
    out = []
    for T in (10, 7):
        ids = torch.randint(3, 17, (4, T), generator=g)
        attn = torch.ones(4, T, dtype=torch.long)
        attn[1, :3] = 0          # left padding
        attn[2, :1] = 0
        attn[3, -2:] = 0         # right padding
        ids = ids.masked_fill(attn == 0, 0)
        out.append((ids, attn))
    return out


def main(model_dir, split, out):
    init_distributed(timeout_s=600)
    seen = []
    record = lambda out, labels: (seen.append(out.logits().detach().float().cpu()), out.h_BTD.new_zeros(()))[1]
    pipe = TwoCircuitPipe(model_dir, json.loads(split), record)
    engine, *_ = deepspeed.initialize(model=pipe, config={"train_micro_batch_size_per_gpu": 4,
                                                          "gradient_accumulation_steps": 1, "steps_per_print": 10**6})
    for ids, attn in batches():
        engine.reset_activation_shape()
        engine.eval_batch(iter([((ids, attn, torch.arange(4)), (ids,))]), num_micro_batches=1, bcast_loss=False)
    if pipe.stage_id == pipe.num_stages - 1:
        from transformers import AutoModelForCausalLM
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
        worst = 0.0
        with torch.no_grad():
            for (ids, attn), got in zip(batches(), seen):
                ref = hf(input_ids=ids, attention_mask=attn, position_ids=positions_from_mask(attn)).logits
                real = attn.bool()
                worst = max(worst, float((got - ref).abs()[real].max()))
                assert torch.isfinite(got[real]).all()
        with open(out, "w") as f:
            json.dump({"max_abs_diff": worst, "stages": pipe.num_stages, "device": str(engine.device)}, f)
    dist.barrier()


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    main(*args)
