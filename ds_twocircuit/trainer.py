"""One fast-circuit GRPO step, top to bottom, and the run loop around it.

    prompts ─► sampler (dense θ_t, rank 0) ─► completions + sampler log-probs ─► verifier ─► rewards
            ─► group advantages ─► broadcast to all stages                        (rollout_side.py)
            ─► [grpo.ref_logprobs = sampler] rank 0's dense base model: reference log-probs of the
               response tokens, broadcast as per-token floats               (sampler/reference.py)
            ─► [anchor] rank 0 ships θ_t and the batch at the fire schedule's steps; every rank
               adopts a newly published sign(M) at the same step                 (anchor/link.py)
            ─► [probe step] codec off: dense log-probs, the true drift, the dense gradient
            ─► pipeline eval (codec keyed by t): reference log-probs (base weights; unless they came
               from the sampler's rank), old log-probs (when > 1 update)
            ─► [grpo.skip_zero_advantage] only the sequences with a non-zero advantage enter the updates
            ─► pipeline train_batch per PPO mini-batch, the optimizer step in its order
               (pipeline/step_order.py) ─► θ_{t+1}                                     (actor.py)
            ─► dense weights to the sampler (sync/) ─► the step's row on rank 0      (step_log.py)
            [rollout.staleness = k] the sampler, in its own process, is asked for step t+1+k's batch
               right after the sync, so it generates while the pipeline trains (rollout_side.py)

A dense step (`train.dense_every`, or the drift controller's) runs every pass of its step with the
codec off and steps its gradient without the anchor's sign correction (exact, it needs none); with `control.*` on, the controller (control.py) reads the probe and sets β and which
steps run dense. A "step" is one rollout iteration; at the default one PPO mini-batch it is one
optimizer step. `Trainer` holds the components, each on every rank: the rollout side, the actor,
the checkpointer, the step log (a do-nothing twin off rank 0), the anchor link and the weight sync.
"""
import contextlib
import dataclasses
import json
import math
import os
import pathlib
import time

import torch
import torch.distributed as dist
from tqdm import tqdm
from transformers import AutoTokenizer

from .metrics import telemetry
from .actor import Actor
from .anchor.link import AnchorLink
from .anchor.worker import INHERITED
from .pipeline.calibration import initial_bases
from .run import provenance
from .run.checkpoint import Checkpointer
from .config import RunConfig, as_dict
from .pipeline import comm, traffic
from .pipeline.engine import build_pipeline
from .pipeline.guard import TrainingStopped, Verdict
from .grpo.loss import LossCoefs
from .grpo.rollouts import minibatch_shards, nonzero_advantage_tokens, response_lengths, shard_slices
from .model.weights import write_index, write_stage_shard
from .rollout_side import RolloutSide
from .sampler import eos_ids
from .step_log import NoStepLog, StepLog
from .sync.weight_sync import WeightSync


class Trainer:
    def __init__(self, run: RunConfig, run_dir: pathlib.Path, model_dir: str, resume: bool, start: dict | None = None):
        """`start`: rank 0's provenance of the starting model (run/provenance.py), recorded in the run dir."""
        tc = self.tc = run.tc
        self.run_dir, self.model_dir = run_dir, model_dir
        p = build_pipeline(model_dir, tc, run.ds)
        self.actor = Actor(p, tc.anchor.alpha if tc.anchor.enabled else None)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.eos_ids = eos_ids(model_dir, tokenizer)
        self.rollouts = RolloutSide(tc, model_dir, tokenizer, sampling=dist.get_rank() == 0)
        if tc.codec.name == "lowrank":
            initial_bases(p, self.rollouts.calibration(p.micro))
        self.checkpoints = Checkpointer(p.engine, run_dir, tc.train.keep_checkpoints)
        self.start, held_fire, ahead = self.checkpoints.load(tc.anchor.enabled) if resume else (0, None, {})
        self.log = StepLog(run, run_dir, self.start, resume) if dist.get_rank() == 0 else NoStepLog()
        if dist.get_rank() == 0:
            provenance.record(run_dir, start or provenance.start_of(model_dir), self.start, dist.get_world_size())
        self.coefs = LossCoefs.from_config(tc.grpo)   # β moves with the drift controller
        if tc.control.enabled:
            self.coefs = dataclasses.replace(self.coefs, kl_coef=self.shared_kl_coef())
        shapes = self.rollouts.weight_shapes()
        self.anchor, self.sign = self._anchor(run, held_fire, shapes) if tc.anchor.enabled else (None, None)
        self.weight_sync = WeightSync(p.engine.grid, p.pipe, getattr(torch, tc.sampler.dtype), shapes)
        self.theta, _ = self.sync_sampler(self.start)   # the sampler starts from the pipeline's weights
        self.rollouts.restore_ahead(ahead)
        for j in range(self.start, self.start + tc.rollout.staleness + 1) if tc.rollout.staleness else ():
            self.request(j)                             # batches start … start+k: from θ_start (or restored)
        self.hosts = self._hosts(p.engine.grid)
        traffic.take(dist.get_world_size())   # what the start moved (the first sync: every weight) is no step's
        self.act_bytes = 2 if any(run.ds.get(k, {}).get("enabled") for k in ("bf16", "fp16")) else 4

    def _hosts(self, grid) -> list[str] | None:
        """Rank 0: each endpoint's host (traffic.host_map), nodes from the launcher where it started
        several (CROSS_SIZE, each rank's CROSS_RANK); None elsewhere."""
        nodes = comm.gather_to_rank0(torch.tensor([int(os.environ.get("CROSS_RANK", "0"))]))   # host, control path
        if nodes is None:
            return None
        stage_of = {grid.stage_to_global(stage_id=s, data=d): s
                    for s in range(grid.pipe_parallel_size) for d in range(grid.data_parallel_size)}
        multi = int(os.environ.get("CROSS_SIZE", "1")) > 1
        return traffic.host_map([stage_of[r] for r in range(len(nodes))], [int(n) for n in nodes] if multi else None,
                                self.tc.anchor.external)

    def _anchor(self, run: RunConfig, held_fire: int | None, shapes) -> tuple[AnchorLink, dict | None]:
        """The anchor process's link, restored to the fire held at the checkpoint; → (it, the held sign(M))."""
        p = self.actor.p
        cfg = {"train_micro_batch_size_per_gpu": p.micro, "optimizer": run.ds.get("optimizer"),
               **{k: run.ds[k] for k in INHERITED if k in run.ds}, "twocircuit": as_dict(self.tc)}
        link = AnchorLink(self.tc, self.run_dir, p, json.dumps(cfg, indent=1), shapes,
                          (held_fire, self.start) if held_fire is not None else None)
        restored = link.restore(held_fire) if held_fire is not None else None
        if restored and restored.bases:
            p.codec.set_bases(restored.bases)
        return link, restored.signs if restored else None

    def run(self) -> None:
        steps, train = self.tc.train.steps, self.tc.train
        if self.start == 0:
            self.evaluate(0)
        streak = 0   # steps in a row skipped for non-finite values (the same on every rank)
        bar = tqdm(range(self.start, steps), desc="grpo", initial=self.start, total=steps, disable=not self.log.writes)
        for t in bar:
            row, verdict = self.step(t)
            streak = streak + 1 if verdict.skipped else 0
            if verdict.skipped:
                self.log.note(f"[train] step {t + 1}: non-finite loss or gradient on stage(s) "
                              f"{sorted(verdict.stages) or '?'}: optimizer step skipped on every rank ({streak} in a row)")
            self.log.record(row)
            bar.set_postfix_str(self.log.postfix(), refresh=False)
            if streak >= train.max_skipped_steps:
                self.close()
                raise TrainingStopped(f"{streak} steps in a row skipped for non-finite loss or gradient (stages "
                                      f"{sorted(verdict.stages) or '?'} at step {t + 1}; train.max_skipped_steps="
                                      f"{train.max_skipped_steps})")
            if self.tc.control.enabled and self.probe_step(t):
                self.coefs = dataclasses.replace(self.coefs, kl_coef=self.shared_kl_coef())
            done = t + 1
            if done % train.eval_every == 0 or done == steps:
                self.evaluate(done)
            if (train.save_every and done % train.save_every == 0) or done == steps:
                self.checkpoints.save(done, self.anchor.held if self.anchor else -1, self.rollouts.ahead_state())
                if self.anchor:
                    self.anchor.checkpointed(done)
                self.checkpoints.prune()
        p = self.actor.p
        self.export(self.run_dir / "model")
        self.close()

    def export(self, out_dir: pathlib.Path) -> None:
        """The pipeline's weights as an HF checkpoint (every rank): each stage of data-parallel
        replica 0 writes its shard, then global rank 0 the index, config, tokenizer and generation config."""
        pipe = self.actor.p.pipe
        if self.actor.p.dp_rank == 0:
            mine = pipe.hf_parameters()
            write_stage_shard(out_dir, pipe.stage_id, pipe.num_stages,
                              {n: mine[n] for n in pipe.hf_names_per_stage()[pipe.stage_id]})
        comm.barrier()
        if dist.get_rank() == 0:
            write_index(out_dir, pipe.hf_names_per_stage(), pipe.config, self.model_dir)

    def close(self) -> None:
        if self.anchor:
            self.anchor.close()
        self.rollouts.close(self.weight_sync.mirror)
        self.log.close()

    def step(self, t: int) -> tuple[dict, Verdict]:
        """Step t on every rank; → (its metrics row on rank 0, empty elsewhere; whether its optimizer
        steps were skipped, the same on every rank)."""
        g, p = self.tc.grpo, self.actor.p
        t0 = time.perf_counter()
        rollout, rollout_bytes = self.rollouts.rollout(t, p.ends, p.ends_group)
        ref_NT1 = self.rollouts.reference_logprobs(rollout, needed=self.coefs.kl_coef > 0 or self.probe_step(t))
        now_NT1 = self.rollouts.rescored_logprobs(rollout, t, needed=self.probe_step(t))
        t1 = time.perf_counter()
        anchor_row = {}
        if self.anchor:
            new, anchor_row = self.anchor.step(t, self.theta, rollout, self.coefs.kl_coef)
            if new:
                self.sign = new.signs
                if new.bases:
                    p.codec.set_bases(new.bases)
        t2 = time.perf_counter()
        shards = minibatch_shards(rollout, g.ppo_mini_batches, p.dp, p.dp_rank)
        refs = [ref_NT1[s] for s in shard_slices(len(ref_NT1), g.ppo_mini_batches, p.dp, p.dp_rank)] \
            if ref_NT1 is not None else None
        now = now_NT1[shard_slices(len(now_NT1), g.ppo_mini_batches, p.dp, p.dp_rank)[0]] if now_NT1 is not None else None
        probe = self.actor.probe(shards[0], refs[0] if refs else None, self.coefs, now) if self.probe_step(t) else None
        dense = self.dense_step(t)
        kept = nonzero_advantage_tokens(rollout, g.ppo_mini_batches) if g.skip_zero_advantage else None
        # a dense step runs every pass uncompressed and steps its true gradient: the sign correction,
        # there to undo the codec's damage, would re-sign it by another batch's stale momentum
        with p.codec.off() if dense else contextlib.nullcontext(), \
                traffic.boundary("boundary_dense" if dense else "boundary_update"):
            partials, grad_norm, verdict = self.actor.update(t, shards, probe, refs, kept, self.coefs,
                                                             None if dense else self.sign, g.ppo_epochs)
        sums = telemetry.sum_to_rank0(partials)
        t3 = time.perf_counter()
        self.theta, sync_row = self.sync_sampler(t + 1)
        if self.tc.rollout.staleness:   # step t+1+k's batch, from θ_{t+1}, generated while t+1 … trains
            self.request(t + 1 + self.tc.rollout.staleness)
        if self.anchor:
            self.anchor.collect()
        t4 = time.perf_counter()
        ledgers = comm.gather_to_rank0(traffic.take(dist.get_world_size()))
        if sums is None:   # the step's sums are rank 0's
            return {}, verdict
        compared = probe is not None and probe.grads is not None
        finished = telemetry.finish(sums, p.num_stages, probe is not None, compared)
        finished.update(traffic.with_baseline(traffic.summarize(ledgers, self.hosts), finished, self.act_bytes))
        if verdict.skipped:   # as actor/grad_norm: no step, no norm
            finished["actor/grad_norm_clipped"] = float("nan")
        return {"step": t + 1, **finished,
                "critic/score/mean": float(rollout.rewards_N.mean()),   # the whole batch, every replica's
                **telemetry.group_shares(rollout.rewards_N, g.group_size, g.skip_zero_advantage),
                **telemetry.reference_bytes(ref_NT1, rollout.resp_NT1), "rollout/bytes": float(rollout_bytes),
                **response_lengths(rollout, self.eos_ids, g.max_new_tokens),
                "actor/grad_norm": grad_norm, "actor/lr": p.engine.get_lr()[0],
                **({"rollout/staleness": float(self.rollouts.staleness(t))} if self.tc.rollout.staleness else {}),
                "train/dense_step": float(dense), "actor/kl_coef": self.coefs.kl_coef, **anchor_row,
                "train/skipped_step": float(verdict.skipped),
                "train/nonfinite_stage": float(min(verdict.stages)) if verdict.stages else -1.0,
                "timing/gen": t1 - t0, "timing/anchor": t2 - t1, "timing/train": t3 - t2, "timing/sync": t4 - t3,
                "timing/step": t4 - t0, **sync_row}, verdict

    def request(self, j: int) -> None:
        """Step j's batch asked of the sampler process; first, when step j − k probes, that step's batch
        rescored at θ_{j−k}, the weights the sampler holds now (the staleness's share of the gap)."""
        t = j - self.tc.rollout.staleness
        self.rollouts.request(j, rescore=t if t >= self.start and self.probe_step(t) else None)

    def probe_step(self, t: int) -> bool:
        return bool(self.tc.train.probe_every) and t % self.tc.train.probe_every == 0

    def dense_step(self, t: int) -> bool:
        """Whether every pass of step t runs with the codec off: the fixed schedule, or the
        controller's call (rank 0 decides, every rank follows)."""
        every = self.tc.train.dense_every
        dense = bool(every) and (t + 1) % every == 0
        if self.tc.control.enabled:
            dense = dense or bool(comm.broadcast_scalar(int(self.log.dense_next()), torch.int64))
        return dense

    def shared_kl_coef(self) -> float:
        """Rank 0's controller β, on every rank (the last stages compute the loss with it); NaN
        carries rank 0's error (a resume it cannot rebuild) so that every rank stops, not only rank 0."""
        beta = comm.broadcast_scalar(self.log.beta(), torch.float64)
        if self.log.control_error or math.isnan(beta):
            raise ValueError(self.log.control_error or "rank 0 could not rebuild the drift controller (see rank 0's error)")
        return beta

    def sync_sampler(self, next_step: int) -> tuple[dict | None, dict]:
        """The stages' weights to the sampler (rollout_side.py); → (every tensor, when the anchor ships θ
        at `next_step`, else None; the sync's metrics)."""
        return self.rollouts.sync(self.weight_sync, bool(self.anchor and self.anchor.ships_at(next_step)), next_step)

    def evaluate(self, step: int) -> None:
        """Held-out greedy accuracy with the sampler's dense weights (rank 0)."""
        result = self.rollouts.evaluate()
        if result is not None:
            self.log.evaluation(step, result)
