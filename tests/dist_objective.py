"""Launched by test_pipeline.py under `deepspeed --num_gpus 8`: the GRPO objective as the pipeline applies it.

4 stages × 2 data-parallel replicas of the tests' model, built by the trainer's own `build_pipeline`
from the tests' config at temperature 0.7 and β = 0.05. Each replica runs `passes.update` (the real
micro-batches, last-stage loss and its scale) on its part of a synthetic rollout (`make_rollout`:
ragged prompts and responses, mixed-sign advantages, π_old and π_ref off π_θ by seeded noise, so
ratios are clipped both ways and dual-clipped), four times:

  plain     AdamW at lr 0, no clip: the gradient each stage's optimizer receives, micro-batches of one
            padded length in batch order (train.trim_micro_batches=never)
  trimmed   the same with micro-batches sorted by length, each trimmed to its own (=always); this and
            the passes below run trimmed
  clipped   lr 0, the true-norm clip (pipeline/clip.py) at MAX_NORM, below the gradient's norm: the
            gradient after the clip, and the norm it read before
  corrected lr 0, no clip, the rollout correction on (CORRECTION: truncation at 2, tokens and sequences
            rejected), μ the rollout's sampler log-probs, which reach the last stage as labels
  direction on-policy, β = 0, a fresh AdamW at lr DIRECTION_LR: log π of every response before and
            after the step

Rank 0 writes the rollout (OUT/rollout.pt); each stage its gradients (OUT/{plain,trimmed,clipped}/grads_stage{s}
.safetensors, data-parallel rank 0); the last stage's replicas their rows' log-probs
(OUT/direction{dp}.pt). The test recomputes the gradients with the HF model and `grpo_token_loss` in
one process (`reference_gradients`), which shares nothing with the pipeline's loss path but the loss
function itself (unit-tested on closed forms in test_loss.py).
"""
import json
import os
import sys

import torch

MAX_NORM = 0.01        # below the synthetic batch's gradient norm (the test asserts it binds)
DIRECTION_LR = 1e-4
TEMPERATURE, BETA = 0.7, 0.05
CORRECTION = dict(is_threshold=2.0, token_bounds=(0.25, 4.0), geometric_bounds=(0.5, 1.5))
OVERRIDES = ("model.layers_per_stage=[2,2,2,2]", f"grpo.temperature={TEMPERATURE}", f"grpo.kl_coef={BETA}")


def make_rollout(model_dir: str, n_groups: int = 16, G: int = 4, T: int = 14):
    """A GRPO batch in the trainer's coordinates (grpo/rollouts.py), seeded: groups of G rows with a
    left-padded prompt of 2–6 tokens in P = 6 columns, responses of 1–8 tokens right-padded to T,
    advantages ~ N(0, 1), and π_old, π_ref = log π_θ(τ) of the HF model + noise of 0.6 and 0.3 nats
    on the response targets. → (Rollout, old_NT1, ref_NT1)."""
    import dataclasses

    from ds_twocircuit.grpo.rollouts import Rollout
    from transformers import AutoConfig
    g = torch.Generator().manual_seed(7)
    N, P = n_groups * G, 6
    V = AutoConfig.from_pretrained(model_dir).vocab_size
    ids, attn, resp = torch.zeros(N, T, dtype=torch.long), torch.zeros(N, T, dtype=torch.long), torch.zeros(N, T - 1)
    for b in range(n_groups):
        lp = int(torch.randint(2, P + 1, (1,), generator=g))
        prompt = torch.randint(3, V, (lp,), generator=g)
        for j in range(G):
            i, lr = b * G + j, int(torch.randint(1, T - P + 1, (1,), generator=g))
            ids[i, P - lp:P], attn[i, P - lp:P + lr] = prompt, 1
            ids[i, P:P + lr] = torch.randint(1, V, (lr,), generator=g)
            resp[i, P - 1:P - 1 + lr] = 1.0           # target column j scores ids[:, j+1]
    r = Rollout(ids_NT=ids, attn_NT=attn, resp_NT1=resp, sampler_logp_NT1=torch.zeros_like(resp),
                rewards_N=torch.zeros(N), adv_N=torch.zeros(N), sample_id_N=torch.arange(N))
    with torch.no_grad():
        logp = hf_logprobs(model_dir, r, TEMPERATURE)[1] * resp
    old = (logp + 0.6 * torch.randn(N, T - 1, generator=g)) * resp
    ref = (logp + 0.3 * torch.randn(N, T - 1, generator=g)) * resp
    adv = torch.randn(N, generator=g)
    return dataclasses.replace(r, sampler_logp_NT1=logp, adv_N=adv), old, ref


def hf_logprobs(model_dir: str, r, temperature: float, weights: dict | None = None):
    """(HF model, log softmax(logits/τ) at each target of `r`, (N, T−1), with grad): the model of
    `model_dir`, with `weights` (HF name → tensor) loaded over it when given. Written out here, not
    grpo.logprobs.head_logprobs, so that the reference shares no code with the pipeline's loss path."""
    from ds_twocircuit.model.pipe import positions_from_mask
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if weights is not None:
        hf.load_state_dict({n: t.float() for n, t in weights.items()}, strict=False)
    logits = hf(input_ids=r.ids_NT, attention_mask=r.attn_NT, position_ids=positions_from_mask(r.attn_NT)).logits
    return hf, torch.log_softmax(logits[:, :-1] / temperature, -1).gather(-1, r.ids_NT[:, 1:, None])[..., 0]


def reference_gradients(model_dir: str, r, old_NT1, ref_NT1, coefs, temperature: float = TEMPERATURE,
                        weights: dict | None = None) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """∇ of the whole batch's GRPO loss (token mean over its response tokens) at the HF model's
    weights (or `weights`), in one process: HF forward, log_softmax(logits/τ) at the targets,
    grpo_token_loss; `old_NT1` None: π_old = π_θ (ρ = 1). → (HF name → gradient, the loss's sums)."""
    from ds_twocircuit.grpo.loss import grpo_token_loss
    hf, logp = hf_logprobs(model_dir, r, temperature, weights)
    old = logp.detach() if old_NT1 is None else old_NT1
    loss, sums = grpo_token_loss(logp, old, ref_NT1, r.adv_N, r.resp_NT1 / r.resp_NT1.sum(), coefs,
                                 r.sampler_logp_NT1 if coefs.correction else None)
    loss.backward()
    return {n: q.grad.clone() for n, q in hf.named_parameters()}, {k: float(v) for k, v in sums.items()}


def main(model_dir, config, out):
    import dataclasses

    import torch.distributed as dist
    from safetensors.torch import save_file

    from ds_twocircuit.config import load_config
    from ds_twocircuit.grpo.loss import LossCoefs
    from ds_twocircuit.grpo.rollout_correction import Correction
    from ds_twocircuit.grpo.rollouts import minibatch_shards, shard_slices
    from ds_twocircuit.pipeline import passes
    from ds_twocircuit.pipeline.clip import TrueNormClip
    from ds_twocircuit.pipeline.engine import build_pipeline, init_distributed
    from ds_twocircuit.pipeline.step_order import install_step_hooks

    run = load_config(config, list(OVERRIDES), world_size=8)
    run.ds["gradient_clipping"] = 0.0                     # the clip is switched per pass below
    init_distributed(run.tc.train.collective_timeout)
    p = build_pipeline(model_dir, run.tc, run.ds)
    coefs = LossCoefs.from_config(run.tc.grpo)
    rollout, old, ref = make_rollout(model_dir)
    if dist.get_rank() == 0:
        torch.save({"rollout": dataclasses.asdict(rollout), "old": old, "ref": ref}, f"{out}/rollout.pt")
    (mb, ntok), = minibatch_shards(rollout, 1, p.dp, p.dp_rank)
    rows = shard_slices(len(old), 1, p.dp, p.dp_rank)[0]

    state = {"clip": None, "grads": None}
    opt = p.engine.basic_optimizer
    install_step_hooks(opt, {
        "clip": lambda: state["clip"] and state["clip"].clip(),
        "compare_before": lambda: state.update(grads={n: q.grad.clone() for n, q in p.pipe.hf_parameters().items()})})

    def update(name, clip, lr, **kw):
        state["clip"] = clip
        for group in opt.param_groups:
            group["lr"] = lr
        passes.update(p, mb, ntok, **kw)
        if p.dp_rank == 0:
            os.makedirs(f"{out}/{name}", exist_ok=True)
            save_file(state["grads"], f"{out}/{name}/grads_stage{p.stage}.safetensors")

    p.trim = "never"                                       # micro-batches of one padded length, in order
    update("plain", None, 0.0, old_NT1=old[rows], ref_NT1=ref[rows], coefs=coefs, old_is_current=False)
    p.trim = "always"                                      # sorted by length, each trimmed to its own
    update("trimmed", None, 0.0, old_NT1=old[rows], ref_NT1=ref[rows], coefs=coefs, old_is_current=False)
    clip = TrueNormClip(p.engine, p.pipe, MAX_NORM, active=True)
    update("clipped", clip, 0.0, old_NT1=old[rows], ref_NT1=ref[rows], coefs=coefs, old_is_current=False)
    if dist.get_rank() == 0:
        json.dump({"pre_clip_norm": clip.last_norm}, open(f"{out}/clip.json", "w"))
    update("corrected", None, 0.0, old_NT1=old[rows], ref_NT1=ref[rows],
           coefs=dataclasses.replace(coefs, correction=Correction(**CORRECTION)), old_is_current=False)

    opt.state.clear()                                      # a fresh AdamW: its first step is −lr·sign(g)
    before = passes.logprobs(p, mb)
    zero = torch.zeros_like(mb.resp_NT1)
    update("direction", None, DIRECTION_LR, old_NT1=zero, ref_NT1=zero, coefs=dataclasses.replace(coefs, kl_coef=0.0),
           old_is_current=True)
    after = passes.logprobs(p, mb)
    if p.last_stage:
        torch.save({"rows": [rows.start, rows.stop], "before": before, "after": after}, f"{out}/direction{p.dp_rank}.pt")
    dist.barrier()


if __name__ == "__main__":
    main(*[a for a in sys.argv[1:] if not a.startswith("--local_rank")])
