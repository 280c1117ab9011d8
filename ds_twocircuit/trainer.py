"""One fast-circuit GRPO step, top to bottom, and the run loop around it.

    prompts ─► sampler (dense θ_t, rank 0) ─► completions + sampler log-probs ─► verifier ─► rewards
            ─► group advantages ─► broadcast to all stages
            ─► [grpo.ref_logprobs = sampler] rank 0's dense base model: reference log-probs of the
               response tokens, broadcast as per-token floats (sampler/reference.py)
            ─► [anchor] rank 0 ships θ_t and the batch at the fire schedule's steps; every rank
               adopts a newly published sign(M) at the same step (anchor/link.py)
            ─► [probe step] codec off: dense log-probs, the true drift, the dense gradient
            ─► pipeline eval (codec keyed by t): reference log-probs (base weights; unless they came
               from the sampler's rank), old log-probs (when > 1 update)
            ─► [grpo.skip_zero_advantage] only the sequences with a non-zero advantage enter the updates
            ─► pipeline train_batch per PPO mini-batch, the optimizer's pre-hooks in order: true-norm
               clip, gradient comparison (probe), sign correction, gradient comparison ─► θ_{t+1}
            ─► dense weights gathered from the stages to the sampler ─► the step's metrics on rank 0

A dense step (`train.dense_every`, or the drift controller's) runs every pass of its step with the
codec off; with `control.*` on, the controller (control.py) reads the probe and sets β and which
steps run dense. A "step" is one rollout iteration; at the default one PPO mini-batch it is one
optimizer step. The sampler lives on global rank 0 beside stage 0; the other ranks wait in the next
collective while it generates. Everything random is keyed by (seed, step), so a resumed run
replays the same batches and samples.
"""
import contextlib
import dataclasses
import json
import os
import pathlib
import time
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm
from transformers import AutoTokenizer

from . import passes, telemetry
from .anchor.correction import SignCorrection
from .anchor.link import AnchorLink
from .calibration import calibration_batch, initial_bases
from .checkpoint import point_latest, seal
from .comm import broadcast_tensors
from .config import RunConfig, as_dict, write_run_config
from .control import DriftController
from .data import build_task, step_rows
from .engine import build_pipeline
from .faults import fault_point
from .grads import GradientComparison, GradientViews
from .guard import FiniteGuard, Verdict
from .grpo.advantages import group_advantages, zero_advantage_groups
from .grpo.loss import LossCoefs, k3_kl
from .grpo.rollouts import (Rollout, minibatch_shards, nonzero_advantage_rows, nonzero_advantage_tokens,
                            response_lengths, shard_slices)
from .logger import RunLogger
from .metrics import MISMATCH_SUMS, Trend, mismatch_sums
from .model.weights import export_pipeline
from .sampler import build_sampler
from .sampler.hf import greedy_accuracy
from .sampler.reference import ReferenceLogProbs, pack, unpack
from .weight_sync import WeightSync, dump_for_tests
from .wire import WireCounter


@dataclass
class Probe:
    partials: dict[str, float]                 # probe/... sums (telemetry.py) and its forward bytes
    grads: dict[str, torch.Tensor] | None      # the dense gradient by HF name (per-parameter precision only)


# loss-side sums that are diagnostics per token, not terms of the loss (see Trainer._loss_sums)
PER_UPDATED_TOKEN = ("actor/kl_loss", "actor/ppo_kl", "actor/entropy", "actor/abs_log_ratio")


class Trainer:
    def __init__(self, run: RunConfig, run_dir: pathlib.Path, model_dir: str, resume: bool):
        self.tc, self.run_dir, self.model_dir = run.tc, run_dir, model_dir
        self.p = build_pipeline(model_dir, self.tc, run.ds)
        self.base = [q.detach().clone() for q in self.p.pipe.parameters()]   # reference policy and θ_0
        self.rank0 = dist.get_rank() == 0
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.eos_id = tokenizer.eos_token_id
        self.task = build_task(self.tc.data, tokenizer) if self.rank0 else None   # the sampler's rank's
        self.coefs = LossCoefs.from_config(self.tc.grpo)   # β moves with the drift controller
        self.wire = WireCounter(self.p.stage)
        self.compare, self.correction = self._gradient_hooks()
        self.guard = FiniteGuard(self.p.engine, self.p.pipe, self.p.loss, own_skip=self.p.per_param_grads)
        self.sign = None      # HF name → sign bits of the anchor fire held, None before the first
        if self.tc.codec.name == "lowrank":
            calib = calibration_batch(tokenizer, self.task, self.p.micro).tensors() if self.rank0 else None
            initial_bases(self.p, Rollout.from_tensors(broadcast_tensors(calib, len(Rollout.__dataclass_fields__))))
        self.start, held_fire = self._load_checkpoint() if resume else (0, None)
        self.control, control_error = None, ""   # the controller lives on rank 0; the others follow its broadcasts
        if self.rank0:
            control_error = self._start_rank0(run, resume)
        if self.tc.control.enabled:
            self.coefs = dataclasses.replace(self.coefs, kl_coef=self.shared_kl_coef(control_error))
        self.anchor = None
        if self.tc.anchor.enabled:
            anchor_cfg = {"train_micro_batch_size_per_gpu": self.p.micro, "optimizer": run.ds.get("optimizer"),
                          "twocircuit": as_dict(self.tc)}
            self.anchor = AnchorLink(self.tc, run_dir, self.p, json.dumps(anchor_cfg, indent=1),
                                     self.shapes if self.rank0 else None,
                                     (held_fire, self.start) if held_fire is not None else None)
            restored = self.anchor.restore(held_fire) if held_fire is not None else None
            if restored:
                self.sign = restored.bits
                if restored.bases:
                    self.p.codec.set_bases(restored.bases)
        self.weight_sync = WeightSync(self.p.engine.grid, self.p.pipe, getattr(torch, self.tc.sampler.dtype),
                                      self.shapes if self.rank0 else None)
        self.theta, _ = self.sync_sampler(self.start)   # the sampler starts from the pipeline's weights

    def _start_rank0(self, run: RunConfig, resume: bool) -> str:
        """Rank 0's part: the run directory, the sampler, the logger, the trends and the controller
        (both continued from the logged rows on resume); → the controller's replay error, or ""."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        for split, n in self.task.left_out.items():
            if n:
                print(f"[data] {n} {split} rows left out: prompts over data.max_prompt_len="
                      f"{self.tc.data.max_prompt_len} tokens", flush=True)
        write_run_config(run, self.run_dir)
        self.sampler = build_sampler(self.model_dir, self.tc)
        self.reference = (ReferenceLogProbs(self.model_dir, self.tc.model.attn_implementation)
                          if self.tc.grpo.ref_logprobs == "sampler" else None)
        self.shapes = self.sampler.weight_shapes()
        self.logger = RunLogger(self.run_dir, {"twocircuit": as_dict(self.tc), **run.ds},
                                self.tc.log.wandb, self.tc.log.project, self.start + 1 if resume else None)
        # a dense step's gap is the backend's alone: the codec's gap trend skips it
        self.trends = {"rollout_corr/kl_slope": Trend("rollout_corr/kl", skip="train/dense_step"),
                       "probe/kl_slope": Trend("probe/actor/kl_loss")}
        self.control = DriftController(self.tc.control, self.tc.grpo.kl_coef) if self.tc.control.enabled else None
        logged = self.logger.rows()
        for old in logged:   # a resumed run continues its windows (and the controller)
            for t in self.trends.values():
                t.update(old)
        return self.control.replay(logged, self.start) if self.control else ""

    def _gradient_hooks(self) -> tuple[GradientComparison, SignCorrection | None]:
        """The optimizer's pre-hooks after the clip, in order: the probe's comparison reads G_comp,
        the anchor's correction re-signs it, the comparison reads the corrected G."""
        views = GradientViews(self.p.engine, self.p.pipe)
        compare = GradientComparison(views)
        correction = SignCorrection(views, self.tc.anchor.alpha) if self.tc.anchor.enabled else None
        opt = self.p.engine.basic_optimizer
        opt.register_step_pre_hook(lambda *_: compare.before())
        if correction:
            opt.register_step_pre_hook(lambda *_: correction.apply())
        opt.register_step_pre_hook(lambda *_: compare.after())
        return compare, correction

    # ---- the run ----------------------------------------------------------------------------
    def run(self) -> None:
        steps = self.tc.train.steps
        if self.start == 0:
            self.evaluate(0)
        streak = 0   # steps in a row skipped for non-finite values (the same on every rank)
        for t in tqdm(range(self.start, steps), desc="grpo", initial=self.start, total=steps, disable=not self.rank0):
            row, verdict = self.step(t)
            streak = streak + 1 if verdict.skipped else 0
            if verdict.skipped and self.rank0:
                tqdm.write(f"[train] step {t + 1}: non-finite loss or gradient on stage(s) {sorted(verdict.stages) or '?'}: "
                           f"optimizer step skipped on every rank ({streak} in a row)")
            if self.rank0:
                for key, trend in self.trends.items():
                    slope = trend.update(row)
                    if slope is not None:
                        row[key] = slope
                if self.control:
                    row.update(self.control.update(row))
                self.logger.log(row)
            if streak >= self.tc.train.max_skipped_steps:
                self.close()
                raise TrainingStopped(f"{streak} steps in a row skipped for non-finite loss or gradient (stages "
                                      f"{sorted(verdict.stages) or '?'} at step {t + 1}; train.max_skipped_steps="
                                      f"{self.tc.train.max_skipped_steps})")
            if self.tc.control.enabled and self.probe_step(t):
                self.coefs = dataclasses.replace(self.coefs, kl_coef=self.shared_kl_coef())
            done = t + 1
            if done % self.tc.train.eval_every == 0 or done == steps:
                self.evaluate(done)
            if (self.tc.train.save_every and done % self.tc.train.save_every == 0) or done == steps:
                self.save_checkpoint(done)
        export_pipeline(self.p.pipe, self.p.dp_rank, self.run_dir / "model", self.model_dir)
        self.close()

    def close(self) -> None:
        if self.anchor:
            self.anchor.close()
        if self.rank0:
            dump_for_tests(self.weight_sync.mirror, self.sampler)
            self.logger.close()
            self.sampler.close()
            if hasattr(self.task.reward, "close"):   # math-verify's helper process
                self.task.reward.close()

    def step(self, t: int) -> tuple[dict, Verdict]:
        """Step t on every rank; → (its metrics row on rank 0, empty elsewhere; whether its optimizer
        steps were skipped, the same on every rank)."""
        t0 = time.perf_counter()
        rollout = self.rollout(t)
        ref_NT1 = self.sampler_reference(t, rollout)
        t1 = time.perf_counter()
        anchor_row = {}
        if self.anchor:
            new, anchor_row = self.anchor.step(t, self.theta, rollout, self.coefs.kl_coef)
            if new:
                self.sign = new.bits
                if new.bases:
                    self.p.codec.set_bases(new.bases)
        t2 = time.perf_counter()
        g = self.tc.grpo
        shards = minibatch_shards(rollout, g.ppo_mini_batches, self.p.dp, self.p.dp_rank)
        refs = [ref_NT1[s] for s in shard_slices(len(ref_NT1), g.ppo_mini_batches, self.p.dp, self.p.dp_rank)] \
            if ref_NT1 is not None else None
        probe = self.probe(shards[0], refs[0] if refs else None) if self.probe_step(t) else None
        dense = self.dense_step(t)
        kept = nonzero_advantage_tokens(rollout, g.ppo_mini_batches) if g.skip_zero_advantage else None
        with self.p.codec.off() if dense else contextlib.nullcontext():   # dense step: every pass uncompressed
            partials, grad_norm, verdict = self.update(t, shards, probe, refs, kept)
        sums = telemetry.sum_to_rank0(partials)
        t3 = time.perf_counter()
        self.theta, sync_row = self.sync_sampler(t + 1)
        if self.anchor:
            self.anchor.collect()
        t4 = time.perf_counter()
        if not self.rank0:
            return {}, verdict
        compared = probe is not None and probe.grads is not None
        return {"step": t + 1, **telemetry.finish(sums, self.p.num_stages, probe is not None, compared),
                "critic/score/mean": float(rollout.rewards_N.mean()),   # the whole batch, every replica's
                **self._group_shares(rollout), **self._ref_bytes(ref_NT1, rollout),
                **response_lengths(rollout, self.eos_id, self.tc.grpo.max_new_tokens),
                "actor/grad_norm": grad_norm, "actor/lr": self.p.engine.get_lr()[0],
                "train/dense_step": float(dense), "actor/kl_coef": self.coefs.kl_coef, **anchor_row,
                "train/skipped_step": float(verdict.skipped),
                "train/nonfinite_stage": float(min(verdict.stages)) if verdict.stages else -1.0,
                "timing/gen": t1 - t0, "timing/anchor": t2 - t1, "timing/train": t3 - t2, "timing/sync": t4 - t3,
                "timing/step": t4 - t0, **sync_row}, verdict

    def probe_step(self, t: int) -> bool:
        return bool(self.tc.train.probe_every) and t % self.tc.train.probe_every == 0

    def dense_step(self, t: int) -> bool:
        """Whether every pass of step t runs with the codec off: the fixed schedule, or the
        controller's call (rank 0 decides, every rank follows)."""
        every = self.tc.train.dense_every
        dense = bool(every) and (t + 1) % every == 0
        if self.tc.control.enabled:
            flag = torch.tensor([int(self.control.dense_next()) if self.rank0 else 0])
            dist.broadcast(flag, src=0)
            dense = dense or bool(flag)
        return dense

    def shared_kl_coef(self, error: str = "") -> float:
        """Rank 0's controller β, on every rank (the last stages compute the loss with it); NaN
        carries rank 0's error (a resume it cannot rebuild) so that every rank stops, not only rank 0."""
        beta = torch.tensor([self.control.beta if self.rank0 and not error else float("nan")], dtype=torch.float64)
        dist.broadcast(beta, src=0)
        if error or beta.isnan():
            raise ValueError(error or "rank 0 could not rebuild the drift controller (see rank 0's error)")
        return float(beta)

    # ---- sampling ---------------------------------------------------------------------------
    def rollout(self, t: int) -> Rollout:
        """Rank 0 samples and scores; every rank receives the batch."""
        g = self.tc.grpo
        ts = None
        if self.rank0:
            rows = self.task.train.select(step_rows(len(self.task.train), g.prompts_per_step, self.tc.train.seed, t))
            with all_threads():
                gen = self.sampler.generate([self.task.prompt(p) for p in rows["problem"]], g.group_size,
                                            max_new_tokens=g.max_new_tokens, temperature=g.temperature,
                                            seed=self.tc.train.seed * 1_000_003 + t)
            answers = [a for a in rows["answer"] for _ in range(g.group_size)]
            rewards = torch.tensor([self.task.reward(x, a) for x, a in zip(gen.texts, answers)])
            ts = Rollout(gen.ids_NT, gen.attn_NT, gen.resp_NT1, gen.logp_NT1, rewards,
                         group_advantages(rewards, g.group_size, g.adv_eps),
                         torch.arange(len(answers))).tensors()
        return Rollout.from_tensors(broadcast_tensors(ts, len(Rollout.__dataclass_fields__)))

    def sampler_reference(self, t: int, rollout: Rollout) -> torch.Tensor | None:
        """With grpo.ref_logprobs = sampler: rank 0's dense base model's log π_ref of the step's response
        tokens, (N, T−1), on every rank; only the response tokens' floats are broadcast. None where the
        pipeline computes them, or no pass of step t needs them (β = 0 and no probe)."""
        if self.tc.grpo.ref_logprobs != "sampler" or not (self.coefs.kl_coef > 0 or self.probe_step(t)):
            return None
        r = rollout
        if self.rank0:
            with all_threads():
                flat = pack(self.reference(r.ids_NT, r.attn_NT, r.resp_NT1, self.tc.grpo.temperature), r.resp_NT1)
        else:
            flat = torch.empty(int((r.resp_NT1 > 0).sum()))
        dist.broadcast(flat, src=0)
        return unpack(flat, r.resp_NT1)

    def _group_shares(self, r: Rollout) -> dict[str, float]:
        """The share of the step's groups whose rewards are all equal (advantage 0), and of those left
        out of the update."""
        share = float(zero_advantage_groups(r.rewards_N, self.tc.grpo.group_size).float().mean())
        return {"train/zero_advantage_groups": share,
                **({"train/skipped_groups": share} if self.tc.grpo.skip_zero_advantage else {})}

    @staticmethod
    def _ref_bytes(ref_NT1: torch.Tensor | None, r: Rollout) -> dict[str, float]:
        """The reference log-probs' bytes to the last stage(s): one float32 per response token."""
        return {} if ref_NT1 is None else {"codec/bytes_ref_logprobs": 4.0 * float((r.resp_NT1 > 0).sum())}

    # ---- training ---------------------------------------------------------------------------
    def probe(self, shard: tuple[Rollout, float], sampler_ref: torch.Tensor | None) -> Probe:
        """Codec off, current weights, the step's first mini-batch: the dense log-probs of the
        sampled tokens (→ probe/rollout_corr/*, the mismatch without the codec's part) and of the
        reference (→ probe/actor/kl_loss, the true drift the controller reads, in every precision);
        with per-parameter gradients also the dense gradient, which the optimizer's hooks compare
        with the compressed and the corrected one (grad/cos_*), and the dense entropy. Its wire
        bytes are kept apart. The reference log-probs come from the sampler's rank when it sent them."""
        mb, ntok = shard
        w = mb.resp_NT1 / max(ntok, 1.0)
        grads, view = None, {}
        with self.p.codec.off(), self.wire.counting() as wire:
            dense = passes.logprobs(self.p, mb)
            ref = sampler_ref if sampler_ref is not None else passes.logprobs(self.p, mb, self.base)
            view["actor/kl_loss"] = float((w * k3_kl(dense, ref)).sum())   # the true drift
            if self.p.per_param_grads:
                grads, sums = passes.dense_gradient(self.p, mb, ntok, ref, self.coefs)
                view["actor/entropy"] = sums.get("actor/entropy")   # the last stage's
        values = {**mismatch_sums(mb.sampler_logp_NT1, dense, w), **view} if self.p.last_stage else None
        partials = {"probe/" + k: v for k, v in telemetry.owned(MISMATCH_SUMS + list(view), values).items()}
        return Probe({**partials, "probe/_bytes_fwd": float(wire.fwd)}, grads)

    def update(self, t: int, shards: list[tuple[Rollout, float]], probe: Probe | None,
               sampler_refs: list[torch.Tensor] | None, kept: list[float] | None) -> tuple[dict, float, Verdict]:
        """Every pass of step t (reference, old, each update) sees the same boundary masks: keyed by t.
        `sampler_refs`: each shard's reference log-probs from the sampler's rank (else a pipeline pass
        computes them); `kept`: with grpo.skip_zero_advantage, each mini-batch's response tokens of
        non-zero advantage, and only those sequences enter the passes (the loss keeps the whole
        mini-batch's token count, so the update is the same at β = 0). → (this rank's metric partials,
        the mean gradient norm of its optimizer steps, which of them were skipped for non-finite values)."""
        g, p = self.tc.grpo, self.p
        on_policy = g.ppo_mini_batches * g.ppo_epochs == 1
        if kept is not None:
            shards = [(nonzero_advantage_rows(mb, p.micro)[0], ntok) for mb, ntok in shards]
        zeros = [torch.zeros_like(mb.resp_NT1) for mb, _ in shards]
        correcting = self.correction.applying(self.sign) if self.correction else contextlib.nullcontext()
        with p.codec.keyed(t), self.wire.counting() as wire:
            with p.codec.counting() as eval_pay:
                refs = zeros if self.coefs.kl_coef == 0 else sampler_refs if sampler_refs is not None else \
                    [passes.logprobs(p, mb, self.base) for mb, _ in shards]
                olds = zeros if on_policy else [passes.logprobs(p, mb) for mb, _ in shards]
            with p.codec.counting() as train_pay, correcting as agreement, self.guard.checking(t) as verdict:
                updates, dots = [], None
                for _ in range(g.ppo_epochs):
                    for (mb, ntok), old, ref in zip(shards, olds, refs):
                        # the probe's dense gradient is of the first mini-batch: compare the first update only
                        with self.compare.comparing(probe.grads if probe and dots is None else None) as d:
                            updates.append(passes.update(p, mb, ntok, old, ref, self.coefs, on_policy))
                        dots = dots or d
        # the means over the tokens that entered the passes: the kept ones' count
        means = shards if kept is None else [(mb, k) for (mb, _), k in zip(shards, kept)]
        scale = [1.0] * len(shards) if kept is None else [ntok / k if k else 0.0 for (_, ntok), k in zip(shards, kept)]
        if on_policy and p.last_stage:
            olds = [updates[0].old_logp]
        partials = telemetry.owned(telemetry.LOSSES, self._loss_sums(updates, scale) if p.last_stage else None)
        if not on_policy:
            first = {telemetry.FIRST_RATIO: updates[0].sums["actor/abs_log_ratio"] * scale[0]} if p.last_stage else None
            partials.update(telemetry.owned([telemetry.FIRST_RATIO], first))
        partials.update(telemetry.owned(MISMATCH_SUMS, self._mismatch_sums(means, olds) if p.last_stage else None))
        partials.update(telemetry.correction_partials(agreement, dots["before"], dots["after"]))
        partials.update(telemetry.movement_partials(p.pipe.parameters(), self.base, p.stage, p.num_stages,
                                                    counted=p.dp_rank == 0))
        partials.update(telemetry.per_stage(telemetry.WIRE, p.stage, p.num_stages, "codec", [
            wire.fwd, wire.bwd, eval_pay.payload + train_pay.payload, eval_pay.dense + train_pay.dense,
            train_pay.grad, train_pay.dense, wire.fwd_fp32, wire.bwd_fp32]))
        partials.update(telemetry.per_stage(["peak_rss_mib"], p.stage, p.num_stages, "memory",
                                            [telemetry.peak_rss_mib() if p.dp_rank == 0 else 0.0]))
        if probe is not None:
            partials.update(probe.partials)
        grad_norm = float("nan") if verdict.skipped else float(np.mean([u.grad_norm for u in updates]))
        return partials, grad_norm, verdict

    @staticmethod
    def _loss_sums(updates: list[passes.Update], scale: list[float]) -> dict[str, torch.Tensor]:
        """The token-mean sums of the step's updates, averaged over them; the diagnostics that are
        means per token (not terms of the loss) × `scale` of their mini-batch, which makes them means
        over the tokens that entered the update when some were left out."""
        total = defaultdict(lambda: torch.zeros(()))
        for i, u in enumerate(updates):
            for k, v in u.sums.items():
                total[k] = total[k] + (v * scale[i % len(scale)] if k in PER_UPDATED_TOKEN else v)
        return {k: v / len(updates) for k, v in total.items()}

    @staticmethod
    def _mismatch_sums(shards, olds) -> dict:
        """Sampler vs trainer log-probs of the sampled tokens (π_old, the weights that sampled them)."""
        total = sum(ntok for _, ntok in shards)
        out = {}
        for (mb, _), old in zip(shards, olds):
            for k, v in mismatch_sums(mb.sampler_logp_NT1, old, mb.resp_NT1 / max(total, 1.0)).items():
                out[k] = out.get(k, 0.0) + v
        return out

    # ---- sampler sync, evaluation, checkpoints ----------------------------------------------
    def sync_sampler(self, next_step: int) -> tuple[dict | None, dict]:
        """The stages' weights to the sampler as deltas in its dtype (weight_sync.py); → (those weights,
        every tensor, when the anchor ships θ at `next_step`, else None; the sync's metrics: wire
        bytes and the changed fraction, the bytes the sampler took in and the seconds it took)."""
        changed, row = self.weight_sync()
        if not self.rank0:
            return None, {}
        t0 = time.perf_counter()
        row["sync/sampler_bytes"] = self.sampler.load_weights(self.weight_sync.mirror, changed)
        row["timing/sampler_load"] = time.perf_counter() - t0
        return (dict(self.weight_sync.mirror) if self.anchor and self.anchor.ships_at(next_step) else None), row

    def evaluate(self, step: int) -> None:
        """Held-out greedy accuracy with the sampler's dense weights (rank 0)."""
        if not self.rank0:
            return
        held = self.task.held_out
        with all_threads():
            acc = greedy_accuracy(self.sampler, [self.task.prompt(p) for p in held["problem"]], held["answer"],
                                  self.task.reward, self.tc.grpo.max_new_tokens)
        self.logger.log({"step": step, "acc": acc, "n": len(held)}, file="eval.jsonl")
        tqdm.write(f"[eval] step {step}: held-out greedy accuracy {acc:.3f} (n={len(held)})")

    def save_checkpoint(self, done: int) -> None:
        """DeepSpeed's save with the held anchor fire, sealed by each node, then named by `latest`
        (checkpoint.py says why), then pinned in the anchor's mailbox (anchor/link.py)."""
        ckpt, tag = self.run_dir / "checkpoints", f"step{done}"
        fault_point("save", done)
        client = {"step": done, "anchor_fire": self.anchor.held if self.anchor else -1}
        self.p.engine.save_checkpoint(str(ckpt), tag=tag, client_state=client, save_latest=False)
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:          # DeepSpeed's save ends in a barrier
            seal(ckpt / tag, f"node{os.environ.get('CROSS_RANK', '0')}")
        dist.barrier()
        if self.rank0:
            point_latest(ckpt, tag)
        if self.anchor:
            self.anchor.checkpointed(done)

    def _load_checkpoint(self) -> tuple[int, int | None]:
        """→ (steps done, the anchor fire held then; None from a checkpoint that did not record it)."""
        ckpt = self.run_dir / "checkpoints"
        if not (ckpt / "latest").is_file():
            raise ValueError(f"--resume: no checkpoint under {ckpt}")
        _, client = self.p.engine.load_checkpoint(str(ckpt))
        fire = client.get("anchor_fire")
        return int(client["step"]), (int(fire) if fire is not None and self.tc.anchor.enabled else None)


class TrainingStopped(RuntimeError):
    """The run cannot go on (every rank raises it at the same step); launch/train.py prints it as one line."""

    label = "training stopped"


class all_threads:
    """Use every core for rank 0's generation: the other ranks are idle in a collective meanwhile."""

    def __enter__(self):
        self.n = torch.get_num_threads()
        torch.set_num_threads(int(os.environ.get("DS_TWOCIRCUIT_GEN_THREADS", os.cpu_count() or 1)))

    def __exit__(self, *exc):
        torch.set_num_threads(self.n)
