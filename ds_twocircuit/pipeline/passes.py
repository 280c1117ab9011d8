"""The pipeline passes of a GRPO step, each a function that returns its result:

    logprobs(p, batch, weights=None)        → log π(target) of every sequence (eval_batch)
    update(p, batch, ntok, old, ref, coefs) → one optimizer step on the GRPO loss (train_batch)
    dense_gradient(p, batch, ntok, ref, coefs) → ∇ of the same loss, forward + backward, no step

DeepSpeed calls one `loss_fn(out, labels)` per micro-batch on the last stage and nowhere else, `out`
the head's `HeadOut(h, W)` (log-probs made from it a chunk of tokens at a time, grpo/logprobs.py);
`LastStage` is that loss_fn, and hands each call to the pass that is running, only while it runs.
Labels per micro-batch: (targets_BT1, weight_BT1, adv_B, old_logp_BT1, ref_logp_BT1[, sampler_logp_BT1]),
the sampler's log-probs only for an update under grpo.rollout_correction. `weight` is
1/N_tokens of the PPO mini-batch on response tokens (target coordinates, grpo/rollouts.py), and the
loss is multiplied back by gradient-accumulation steps × data-parallel size, which DeepSpeed
divides by, so the gradient is exactly the global token-mean's however the batch is split.

Every pass over a batch lays its micro-batches out the same way (`plan`: padded, or cut by length
and trimmed, layout.py), chosen from the batch's lengths and the run's codec as configured, so the
probe's and a dense step's codec-off passes match the compressed ones. A token's position (from the
mask) and sample id, hence its codec keys, do not depend on the layout, and the loss's weights are
the global token-mean's; a trimmed pass moves only float order (which rows share a matmul, the
length attention runs at, the rank code's per-micro-batch draw). The last stage's per-micro-batch
log-probs go back to (N, T−1) in the batch's order.

DeepSpeed sizes its receive buffers from the shape message, which it sends once and caches unless
told otherwise, and reuses them (in the sender's dtype: recv_buffers.py); so a padded pass whose
padded length, prompt columns or codec on/off differ from the last pass's, and every trimmed pass,
first drops them on every rank (`shaped`), and a trimmed pass sends its shapes with every micro-batch.
"""
import contextlib
import dataclasses
from collections import defaultdict
from dataclasses import dataclass

import torch

from ..codec import shared_prompts
from ..grpo.logprobs import head_logprobs
from ..grpo.loss import LossCoefs, grpo_token_loss
from ..grpo.rollouts import Rollout
from ..codec.geometry import cut_layers
from ..model.pipe import HeadOut, check_contiguous, span_from_mask
from .layout import Layout, choose_layout


class LastStage:
    """DeepSpeed's `loss_fn`: the running pass's loss of one micro-batch's head output."""

    def __init__(self):
        self.current = None

    def __call__(self, out: HeadOut, labels):
        assert self.current is not None, "DeepSpeed called loss_fn outside a pass"
        return self.current(out, labels)

    @contextlib.contextmanager
    def running(self, fn):
        self.current = fn
        try:
            yield fn
        finally:
            self.current = None


class _LogProbs:
    """Records log π of each micro-batch's targets; returns a zero scalar (eval_batch needs one)."""

    def __init__(self, temperature: float):
        self.temperature, self.logps = temperature, []

    def __call__(self, out: HeadOut, labels):
        logp, _ = head_logprobs(out.h_BTD[:, :-1], out.weight_VD, labels[0], self.temperature)
        self.logps.append(logp.detach())
        return logp.new_zeros(())


class _GRPOLoss:
    """The GRPO token loss of each micro-batch (scaled, see the module docstring), its metric sums,
    and with `old_is_current` π_old = the current forward detached (one update per rollout: ρ = 1
    exactly, no extra pass), whose log-probs it records."""

    def __init__(self, coefs: LossCoefs, temperature: float, scale: int, old_is_current: bool):
        self.coefs, self.temperature, self.scale, self.old_is_current = coefs, temperature, scale, old_is_current
        self.logps: list[torch.Tensor] = []
        self.sums: dict[str, torch.Tensor] = defaultdict(float)   # 0.0 + the first micro-batch's, on its device

    def __call__(self, out: HeadOut, labels):
        targets, weight, adv, old, ref, *behav = labels
        logp, entropy = head_logprobs(out.h_BTD[:, :-1], out.weight_VD, targets, self.temperature)
        if self.old_is_current:
            old = logp.detach()
            self.logps.append(old)
        loss, sums = grpo_token_loss(logp, old, ref, adv, weight, self.coefs, *behav)
        sums["actor/entropy"] = (weight * entropy).sum()
        for k, v in sums.items():
            self.sums[k] += v
        return loss * self.scale


@dataclass
class Update:
    sums: dict[str, torch.Tensor]    # loss metric sums over the micro-batches (last stage; empty elsewhere)
    old_logp: torch.Tensor | None    # on-policy: log π_old of the targets, (N, T−1) (last stage)
    grad_norm: float                 # the global gradient norm before clipping
    layout: Layout                   # how its micro-batches were laid out (the same on every rank)


def plan(p, batch: Rollout) -> Layout:
    """The layout of every pass over `batch`, the same on every rank of the pipeline (each holds the
    batch's masks) and for every pass of it: the rule reads the run's codec as configured, on, and a
    training pass's bytes, so the probe's and a dense step's codec-off passes lay the batch out as
    the compressed ones do."""
    N, T = batch.attn_NT.shape
    act_bytes = 2 if p.engine.bfloat16_enabled() else 4
    cuts = [p.codec.token_bytes(c, act_bytes, True, p.micro * T) for c in cut_layers(p.pipe.layers_per_stage)]
    return choose_layout(span_from_mask(batch.attn_NT), T, p.micro, p.share_group, cuts, p.trim)


def micro_batches(r: Rollout, lay: Layout, weight_NT1, old_NT1, ref_NT1, share: int = 0, behav: bool = False):
    """DeepSpeed's ((ids, attn, sid[, [P, G]]), labels) micro-batches of `lay`, in its order; with
    `share` = G the inputs also say which prompt columns a group shares (codec/shared_prompts.py);
    with `behav` the labels end with the sampler's log-probs (the rollout correction's μ)."""
    check_contiguous(r.attn_NT)
    prompt = shared_prompts.prompt_columns(r.resp_NT1) if share else 0   # responses start at one column
    for rows, (lo, hi) in zip(lay.rows, lay.cols):
        ids, t = r.ids_NT[rows, lo:hi], slice(lo, hi - 1)
        P = prompt - lo if prompt else 0
        if P:
            shared_prompts.check_groups(ids, P, share)
        extra = (torch.tensor([P, share]),) if P else ()
        mu = (r.sampler_logp_NT1[rows, t],) if behav else ()
        yield ((ids, r.attn_NT[rows, lo:hi], r.sample_id_N[rows], *extra),
               (ids[:, 1:], weight_NT1[rows, t], r.adv_N[rows], old_NT1[rows, t], ref_NT1[rows, t], *mu))


def host_logprobs(logps: list[torch.Tensor], lay: Layout) -> torch.Tensor:
    """The last stage's log-probs of a pass, each micro-batch's (rows, hi − lo − 1), back to (N, T−1)
    in the batch's order (0 outside a micro-batch's columns), on the host beside the rollout they
    score (its masks, the sampler's log-probs; DeepSpeed moves them back to the device as labels)."""
    if not lay.trimmed:
        return torch.cat(logps).cpu()
    N, T = lay.shape
    out = logps[0].new_zeros(N, T - 1, device="cpu")
    for lp, rows, (lo, hi) in zip(logps, lay.rows, lay.cols):
        out[rows, lo:hi - 1] = lp.cpu()
    return out


@contextlib.contextmanager
def shaped(p, batch: Rollout, lay: Layout):
    """Run a pass of `lay` with DeepSpeed's buffers fit to it: dropped on every rank when the shapes
    change (a padded pass of another length, prompt columns or codec on/off; any trimmed pass), and
    its shape messages sent with every micro-batch while trimmed."""
    key = None if lay.trimmed else (lay.shape[1], shared_prompts.prompt_columns(batch.resp_NT1) if p.share_group
                                    else 0, p.codec.on)
    if key is None or key != p.shape_key:
        p.engine.reset_activation_shape()
    p.shape_key = key
    p.engine.dynamic_shape = lay.trimmed
    try:
        yield
    finally:
        p.engine.dynamic_shape = False


def logprobs(p, batch: Rollout, weights: list[torch.Tensor] | None = None) -> torch.Tensor:
    """log π(target) of every sequence, (N, T−1), at the current weights or with `weights` swapped in
    (the reference policy); on the last stage, zeros elsewhere."""
    lay = plan(p, batch)
    z = torch.zeros_like(batch.resp_NT1)
    data = iter(micro_batches(batch, lay, z, z, z, p.share_group))
    with p.loss.running(_LogProbs(p.temperature)) as fn, swapped_weights(p.pipe, weights), shaped(p, batch, lay):
        p.engine.eval_batch(data, num_micro_batches=len(lay.rows), bcast_loss=False)
    return host_logprobs(fn.logps, lay) if p.last_stage else z


def update(p, batch: Rollout, ntok: float, old_NT1, ref_NT1, coefs: LossCoefs, old_is_current: bool) -> Update:
    """One `train_batch` on this replica's part of a PPO mini-batch of `ntok` response tokens; the
    optimizer's pre-hooks (clip, sign correction) run inside it."""
    lay = plan(p, batch)
    w = batch.resp_NT1 / max(ntok, 1.0)
    loss = _GRPOLoss(coefs, p.temperature, p.engine.gradient_accumulation_steps() * p.dp, old_is_current)
    with p.loss.running(loss), micro_batch_count(p.engine, len(lay.rows)), shaped(p, batch, lay):
        p.engine.train_batch(iter(micro_batches(batch, lay, w, old_NT1, ref_NT1, p.share_group,
                                                behav=coefs.correction is not None)))
    old = host_logprobs(loss.logps, lay) if old_is_current and p.last_stage else None
    return Update(sums=dict(loss.sums), old_logp=old, grad_norm=p.clip.norm(), layout=lay)


def dense_gradient(p, batch: Rollout, ntok: float, ref_NT1, coefs: LossCoefs):
    """∇ of the GRPO loss at the current weights (π_old = π_θ, so ρ = 1), with DeepSpeed's reductions
    over tied copies and data-parallel replicas but no optimizer step: the anchor's replay and the
    trainer's probe; on-policy at the dense weights, so without the rollout correction (its weights
    there are the sampler's numerics alone). → (HF name → gradient of every parameter this rank holds,
    loss metric sums); .grad is cleared after."""
    lay = plan(p, batch)
    w = batch.resp_NT1 / max(ntok, 1.0)
    z = torch.zeros_like(batch.resp_NT1)
    loss = _GRPOLoss(dataclasses.replace(coefs, correction=None), p.temperature, p.engine.gradient_accumulation_steps() * p.dp, old_is_current=True)
    with p.loss.running(loss), shaped(p, batch, lay):
        forward_backward(p.engine, micro_batches(batch, lay, w, z, ref_NT1, p.share_group))
    grads = {n: q.grad.detach().float().clone() for n, q in p.pipe.hf_parameters_all().items()}
    for q in p.pipe.parameters():
        q.grad = None
    return grads, dict(loss.sums)


class _NoOptimizerStep:
    """A pipeline schedule with its OptimizerStep instructions removed (forward + backward + reductions)."""

    def __init__(self, sched):
        self.sched = sched

    def num_pipe_buffers(self):
        return self.sched.num_pipe_buffers()

    def __iter__(self):
        from deepspeed.runtime.pipe.schedule import OptimizerStep
        for cmds in self.sched:
            yield [c for c in cmds if not isinstance(c, OptimizerStep)]


def forward_backward(engine, data_iter) -> None:
    """`train_batch` without the optimizer step: the gradients stay in .grad, reduced over tied copies
    and data-parallel replicas as DeepSpeed does before a step. Drives DeepSpeed's own schedule
    executor (`_exec_schedule`), the same path `train_batch` takes."""
    engine.set_dataiterator(data_iter)
    engine.module.train()
    engine.total_loss, engine.total_additional_losses, engine._compute_loss = None, None, True
    engine._exec_schedule(_NoOptimizerStep(engine._train_schedule()))


@contextlib.contextmanager
def micro_batch_count(engine, n: int):
    """`train_batch` over n micro-batches instead of the configured gradient-accumulation steps (a
    batch with sequences left out). DeepSpeed's schedule reads `engine.micro_batches`; its gradient
    scaling stays 1/gradient_accumulation_steps per micro-batch, which the loss's scale undoes, so the
    gradient is the token-mean sum over the micro-batches that ran."""
    configured, engine.micro_batches = engine.micro_batches, n
    try:
        yield
    finally:
        engine.micro_batches = configured


@contextlib.contextmanager
def swapped_weights(pipe, other: list[torch.Tensor] | None):
    """Run with `other` in place of the stage's parameters (zero-copy swap of .data), then swap back;
    `other=None` runs with the stage's own."""
    params = list(pipe.parameters()) if other is not None else []
    for q, o in zip(params, other or []):
        q.data, o.data = o.data, q.data
    try:
        yield
    finally:
        for q, o in zip(params, other or []):
            q.data, o.data = o.data, q.data
