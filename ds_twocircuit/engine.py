"""DeepSpeed glue: the pipeline engine, its last-stage loss, micro-batches, clipping, weight moves.

Everything that touches DeepSpeed's pipeline engine or torch.distributed lives here, so the math
(grpo/, metrics.py) stays pure and `trainer.py` reads as the algorithm.
"""
import contextlib
import copy
from collections import defaultdict

import deepspeed
import torch
import torch.distributed as dist

from .anchor.sign import corrected_gradient
from .codec.boundary import DTYPES, CodecState, cut_layers, top_basis
from .config import codec_cuts, codec_keep
from .grpo.loss import LossCoefs, grpo_token_loss, token_logprobs
from .grpo.rollouts import Rollout
from .model.pipe import Embed, TwoCircuitPipe, load_hf_config


class PipeLoss:
    """DeepSpeed's `loss_fn(outputs, labels)` on the last stage.

    Labels per micro-batch: (targets_BT1, weight_BT1, adv_B, old_logp_BT1, ref_logp_BT1). `weight` is 1/N_tokens of the mini-batch on response tokens; the returned loss
    is multiplied by `scale` = grad-accumulation × data-parallel size to undo DeepSpeed's averaging,
    so the gradient is exactly the global token-mean's. Mode "logprob" only records log π of the
    targets (returns a zero scalar, as eval_batch needs one). With `old_is_current`, π_old is the
    current forward detached (one update per rollout: ρ = 1 exactly, no extra pass)."""

    def __init__(self, coefs: LossCoefs, temperature: float):
        self.coefs, self.temperature = coefs, temperature
        self.mode, self.scale, self.old_is_current = "train", 1.0, True
        self.reset()

    def reset(self):
        self.logps: list[torch.Tensor] = []
        self.sums: dict[str, torch.Tensor] = defaultdict(lambda: torch.zeros(()))

    def __call__(self, logits_BTV, labels):
        targets, weight, adv, old, ref = labels
        logp, entropy = token_logprobs(logits_BTV[:, :-1], targets, self.temperature)
        if self.mode == "logprob":
            self.logps.append(logp.detach())
            return logp.new_zeros(())
        if self.old_is_current:
            old = logp.detach()
            self.logps.append(old)
        loss, sums = grpo_token_loss(logp, old, ref, adv, weight, self.coefs)
        sums["actor/entropy"] = (weight * entropy).sum()
        for k, v in sums.items():
            self.sums[k] += v
        return loss * self.scale


def init_distributed() -> None:
    """gloo on CPU (DeepSpeed's CPU default, oneCCL, is rarely installed), the accelerator's own elsewhere.

    DeepSpeed's CPU backend also JIT-builds a shared-memory all-reduce op for inference and leaves a
    69 MB /dev/shm file per rank behind; training never uses it, so it is switched off here."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator
    if get_accelerator().device_name() == "cpu":
        getattr(deepspeed.ops, "__compatible_ops__", {})["deepspeed_shm_comm"] = False
    backend = "gloo" if get_accelerator().device_name() == "cpu" else get_accelerator().communication_backend_name()
    deepspeed.init_distributed(dist_backend=backend)


def build_codec(tc, hidden_size: int) -> CodecState:
    c = tc.codec
    return CodecState(name=c.name, d=hidden_size, k=codec_keep(c, hidden_size), seed=c.seed,
                      cuts=frozenset(codec_cuts(c, tc.model.layers_per_stage)), payload_dtype=DTYPES[c.payload_dtype])


def build_engine(model_dir: str, tc, ds_config: dict):
    """→ (engine, pipe, loss). Clipping is taken out of DeepSpeed's hands in plain fp32 (see `TrueNormClip`)."""
    loss = PipeLoss(LossCoefs(tc.grpo.clip_low, tc.grpo.clip_high, tc.grpo.clip_ratio_c, tc.grpo.kl_coef),
                    tc.grpo.temperature)
    codec = build_codec(tc, load_hf_config(model_dir, tc.model.attn_implementation).hidden_size)
    pipe = TwoCircuitPipe(model_dir, tc.model.layers_per_stage, loss, tc.model.attn_implementation, codec=codec)
    ds = copy.deepcopy(ds_config)
    clip = ds.get("gradient_clipping", 1.0)   # DeepSpeed's default is 1.0
    own_clip = not (ds.get("bf16", {}).get("enabled") or ds.get("fp16", {}).get("enabled")
                    or ds.get("zero_optimization", {}).get("stage", 0) > 0)
    if own_clip:
        ds["gradient_clipping"] = 0.0
    engine, _, _, _ = deepspeed.initialize(model=pipe, model_parameters=[p for p in pipe.parameters()
                                                                         if p.requires_grad], config=ds)
    engine.true_norm_clip = TrueNormClip(engine, pipe, clip, own_clip)
    return engine, pipe, loss


class TrueNormClip:
    """Gradient clipping by the true global norm across all pipeline stages (plain fp32 path).

    DeepSpeed 0.19.8's fp32 pipeline path treats the pipe group as model-parallel and clips by a
    norm that counts only stage 0's gradients (see DEEPSPEED_NOTES). Here every stage's squared norm
    is all-reduced over the pipe group, the tied head's duplicate counted once, and all stages scale
    by the same factor, before the optimizer consumes the gradient (a step pre-hook). In bf16 and
    ZeRO-1 DeepSpeed's own clip is already correct and this only reports its norm."""

    def __init__(self, engine, pipe: TwoCircuitPipe, max_norm: float, active: bool):
        self.engine, self.max_norm, self.active, self.last_norm = engine, max_norm, active, float("nan")
        dup = {id(p) for m in pipe.modules() if isinstance(m, Embed) and pipe.stage_id != 0 for p in m.parameters()}
        self.params = [p for p in pipe.parameters() if p.requires_grad and id(p) not in dup]
        self.group = engine.grid.get_pipe_parallel_group()
        if self.active:
            engine.optimizer.register_step_pre_hook(lambda *_: self.clip())

    @torch.no_grad()
    def clip(self) -> None:
        sq = torch.zeros((), dtype=torch.float64)
        for p in self.params:
            if p.grad is not None:
                sq += p.grad.double().pow(2).sum()
        dist.all_reduce(sq, group=self.group)
        self.last_norm = float(sq.sqrt())
        if self.max_norm > 0 and self.last_norm > self.max_norm:
            coef = self.max_norm / (self.last_norm + 1e-6)
            for p in self.engine.module.parameters():   # every copy, tied duplicates included
                if p.grad is not None:
                    p.grad.mul_(coef)

    def norm(self) -> float:
        return self.last_norm if self.active else float(self.engine.get_global_grad_norm() or float("nan"))


class SignCorrection:
    """The anchor's correction, in the optimizer's step pre-hook (after the clip), on this rank's gradients:

        G = α·G_comp + (1−α)·|G_comp| ⊙ sign(M)            (anchor/sign.py)

    `signs` (HF name → bool tensor of the parameter's shape, True where M > 0) is None until the
    first sign arrives, and the gradient passes unchanged. In plain fp32 the optimizer steps the
    parameters and each .grad is corrected. Under bf16 and ZeRO-1 it steps flat fp32 partitions;
    DeepSpeed's `_hp_mapping` on each parameter says which slice of which partition holds which of its
    elements (hp start, lp start, numel), so every bit lands on its own coordinate. The hook also sums
    this step's statistics (`take_stats`): sign agreement counts and, when `dense` holds a probe's
    dense gradient, the dot products behind grad/cos_comp_dense and grad/cos_corrected_dense."""

    def __init__(self, engine, pipe: TwoCircuitPipe, alpha: float):
        self.engine, self.alpha = engine, alpha
        named = pipe.hf_parameters_all()
        tied_copy = pipe.stage_id > 0 and "model.embed_tokens.weight" in named
        self.name_of = {id(p): n for n, p in named.items()}
        self.named = named
        # statistics count each coordinate once: not the tied copy; in fp32 only data-parallel rank 0
        self.uncounted = {"model.embed_tokens.weight"} if tied_copy else set()
        self.dp_rank = engine.grid.get_data_parallel_rank()
        self.signs: dict[str, torch.Tensor] | None = None
        self.dense: dict[str, torch.Tensor] | None = None
        self.stats = torch.zeros(7, dtype=torch.float64)   # agree, numel, c·d, c·c, k·d, k·k, d·d
        self._fragments = None
        engine.basic_optimizer.register_step_pre_hook(lambda *_: self.apply())

    def fragments(self) -> dict[int, list]:
        """Flat partition (keyed by its storage) → [(name, hp start, lp start, numel)]; empty in fp32."""
        if self._fragments is None:
            self._fragments = defaultdict(list)
            for n, p in self.named.items():
                m = getattr(p, "_hp_mapping", None)
                if m is not None:
                    self._fragments[m.hp_fragment.untyped_storage().data_ptr()].append(
                        (n, m.hp_fragment_address.start, m.lp_fragment_address.start, m.lp_fragment_address.numel))
        return self._fragments

    @torch.no_grad()
    def apply(self) -> None:
        frags = self.fragments()
        for group in self.engine.basic_optimizer.param_groups:
            for flat in group["params"]:
                if flat.grad is None:
                    continue
                g = flat.grad.view(-1)
                key = flat.untyped_storage().data_ptr()
                if key in frags:
                    for name, hp, lp, n in frags[key]:
                        self._correct(name, g.narrow(0, hp, n), lp, count=True)
                elif id(flat) in self.name_of:
                    self._correct(self.name_of[id(flat)], g, 0, count=self.dp_rank == 0)

    def _correct(self, name: str, g: torch.Tensor, lp: int, count: bool) -> None:
        count = count and name not in self.uncounted
        s = self.signs[name].view(-1).narrow(0, lp, g.numel()) if self.signs is not None else None
        new = corrected_gradient(g, s, self.alpha) if s is not None else g
        if count:
            gd = g.double()
            if s is not None:
                self.stats[0] += float(((g > 0) == s).sum() + ((g == 0) & s).sum())
                self.stats[1] += g.numel()
            if self.dense is not None:
                d, k = self.dense[name].view(-1).narrow(0, lp, g.numel()).double(), new.double()
                self.stats[2:] += torch.stack([gd @ d, gd @ gd, k @ d, k @ k, d @ d])
        if s is not None:
            g.copy_(new)

    def take_stats(self) -> torch.Tensor:
        out, self.stats = self.stats, torch.zeros(7, dtype=torch.float64)
        return out


def micro_batches(r: Rollout, micro: int, weight_NT1, old_NT1, ref_NT1):
    """Yield DeepSpeed's ((ids, attn, sid), labels) micro-batches of `micro` sequences, in order."""
    for i in range(0, r.ids_NT.shape[0], micro):
        s = slice(i, i + micro)
        yield ((r.ids_NT[s], r.attn_NT[s], r.sample_id_N[s]),
               (r.ids_NT[s, 1:], weight_NT1[s], r.adv_N[s], old_NT1[s], ref_NT1[s]))


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
    and data-parallel replicas as DeepSpeed does before a step. Used where a gradient is measured, not
    applied (the anchor's dense replay, the trainer's dense probe). Drives DeepSpeed's own schedule
    executor (`_exec_schedule`), the same path `train_batch` takes."""
    engine.set_dataiterator(data_iter)
    engine.module.train()
    engine.total_loss, engine.total_additional_losses, engine._compute_loss = None, None, True
    engine._exec_schedule(_NoOptimizerStep(engine._train_schedule()))


def pipeline_logprobs(engine, loss: PipeLoss, batches, n_micro: int) -> list[torch.Tensor]:
    """Per-token log π of the targets of `n_micro` micro-batches (last stage; [] elsewhere)."""
    loss.reset()
    loss.mode = "logprob"
    try:
        engine.eval_batch(batches, num_micro_batches=n_micro, bcast_loss=False)
    finally:
        loss.mode = "train"
    return loss.logps


@contextlib.contextmanager
def swapped_weights(pipe: TwoCircuitPipe, other: list[torch.Tensor]):
    """Run with `other` in place of the stage's parameters (zero-copy swap of .data), then swap back."""
    params = list(pipe.parameters())
    for p, o in zip(params, other):
        p.data, o.data = o.data, p.data
    try:
        yield
    finally:
        for p, o in zip(params, other):
            p.data, o.data = o.data, p.data


def broadcast_tensors(ts: list[torch.Tensor] | None, n: int, src: int = 0) -> list[torch.Tensor]:
    """Broadcast a list of n tensors (any shapes/dtypes) from src; other ranks pass None."""
    meta = [None]
    if dist.get_rank() == src:
        meta = [[(tuple(t.shape), t.dtype) for t in ts]]
    dist.broadcast_object_list(meta, src=src)   # shapes only: a few hundred bytes, within our own world
    if dist.get_rank() != src:
        ts = [torch.empty(shape, dtype=dtype) for shape, dtype in meta[0]]
    for t in ts:
        dist.broadcast(t, src=src)
    assert len(ts) == n
    return ts


def gather_stage_weights(engine, pipe: TwoCircuitPipe, shapes: dict | None):
    """Dense weights from every stage to global rank 0 (p2p, one flat fp32 buffer per stage).

    → (list of (hf_name, tensor)) on rank 0, None elsewhere; and the bytes moved."""
    names = pipe.hf_names_per_stage()
    if engine.grid.get_data_parallel_rank() != 0:
        return None, 0
    mine = pipe.hf_parameters()
    if dist.get_rank() != 0:
        flat = torch.cat([mine[n].detach().float().reshape(-1) for n in names[pipe.stage_id]])
        dist.send(flat, dst=0)
        return None, 0
    out, nbytes = [(n, mine[n].detach()) for n in names[0]], 0
    for s in range(1, pipe.num_stages):
        numel = [shapes[n][0].numel() for n in names[s]]
        flat = torch.empty(sum(numel))
        dist.recv(flat, src=engine.grid.stage_to_global(stage_id=s, data=0))
        nbytes += flat.numel() * flat.element_size()
        out += [(n, t.view(shapes[n][0])) for n, t in zip(names[s], flat.split(numel))]
    return out, nbytes


class WireCounter:
    """Bytes handed to DeepSpeed's p2p layer by this rank, split by direction (next stage = forward).

    Counts everything the pipeline sends: payloads, gradients, side tensors and shape metadata. The
    engine calls `p2p.send` through the module, so wrapping the module function sees every send."""

    def __init__(self, stage_id: int):
        from deepspeed.runtime.pipe import p2p
        self.stage_id, self.fwd, self.bwd = stage_id, 0, 0
        inner = getattr(p2p.send, "__wrapped__", p2p.send)

        def send(tensor, dest_stage, async_op=False):
            n = tensor.numel() * tensor.element_size()
            if dest_stage > self.stage_id:
                self.fwd += n
            else:
                self.bwd += n
            return inner(tensor, dest_stage, async_op=async_op)

        send.__wrapped__ = inner
        p2p.send = send

    def take(self) -> tuple[int, int]:
        out = (self.fwd, self.bwd)
        self.fwd = self.bwd = 0
        return out


def calibrate_bases(engine, pipe: TwoCircuitPipe, run_pass) -> int:
    """Lowrank initial bases from the base model's activations: run `run_pass()` (a dense forward of a
    calibration batch) recording every cut's input; the sending stage computes Q by SVD and sends it
    to the receiving stage, so both ends hold the same Q. → bytes sent."""
    codec = pipe.codec
    codec.recording, enabled = {}, codec.enabled
    codec.enabled = False
    run_pass()
    codec.enabled = enabled
    recorded, codec.recording = codec.recording, None
    dp, sent = engine.grid.get_data_parallel_rank(), 0
    for b, layer in enumerate(cut_layers(pipe.layers_per_stage)):
        if layer not in codec.cuts:
            continue
        if pipe.stage_id == b:
            q = top_basis(torch.cat(recorded[layer]), codec.k)
            dist.send(q, dst=engine.grid.stage_to_global(stage_id=b + 1, data=dp))
            sent += q.numel() * q.element_size()
        elif pipe.stage_id == b + 1:
            q = torch.empty(codec.d, codec.k)
            dist.recv(q, src=engine.grid.stage_to_global(stage_id=b, data=dp))
        else:
            continue
        codec.set_basis(layer, q)
    return sent
