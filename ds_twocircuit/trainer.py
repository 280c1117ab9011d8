"""One fast-circuit GRPO step, top to bottom, and the run loop around it.

    prompts ─► sampler (dense θ_t, rank 0) ─► completions + sampler log-probs ─► verifier ─► rewards
            ─► group advantages ─► broadcast to all stages
            ─► pipeline eval: reference log-probs (base weights), old log-probs (when > 1 update)
            ─► pipeline train_batch per PPO mini-batch (true-norm clip, then the anchor's sign
               correction, in the optimizer's pre-hook) ─► optimizer ─► θ_{t+1}
            ─► dense weights gathered from the stages to the sampler

With the anchor on, rank 0 also ships θ(t) and the batch at the steps the fire schedule replays, and
every rank switches to a newly published sign(M) at the same step (anchor/link.py). Every
`probe_every` steps a codec-off probe measures the dense view of the same batch; with `control.*` on,
the drift controller (control.py) reads it and sets β and which steps run dense.

A "step" is one rollout iteration; at the default one PPO mini-batch it is one optimizer step.
The sampler lives on global rank 0 beside stage 0; the other ranks wait in the next collective
while it generates. Everything random is keyed by (seed, step), so a resumed run replays the same
batches and samples.
"""
import dataclasses
import json
import os
import pathlib
import time

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from . import engine as eng
from .anchor.link import AnchorLink
from .config import RunConfig, to_yaml
from .control import DriftController
from .data import build_task
from .grpo.advantages import group_advantages
from .grpo.loss import k3_kl
from .grpo.rollouts import Rollout
from .metrics import RunLogger, Trend, finish_mismatch, mismatch_sums
from .model.weights import write_index, write_stage_shard
from .sampler.hf import HFSampler, greedy_accuracy


class Trainer:
    def __init__(self, run: RunConfig, run_dir: pathlib.Path, model_dir: str, resume: bool):
        self.run_cfg, self.tc, self.run_dir, self.model_dir = run, run.tc, run_dir, model_dir
        self.engine, self.pipe, self.loss = eng.build_engine(model_dir, self.tc, run.ds)
        self.base = [p.detach().clone() for p in self.pipe.parameters()]   # reference policy and θ_0
        self.rank0 = dist.get_rank() == 0
        self.last_stage = self.pipe.stage_id == self.pipe.num_stages - 1
        self.task = build_task(self.tc.data)
        self.micro = run.ds["train_micro_batch_size_per_gpu"]
        self.codec = self.pipe.codec
        self.wire = eng.WireCounter(self.pipe.stage_id)
        self.wire_shape = None
        if self.codec.name == "lowrank":
            self.reset_shape_if_changed(-1)
            eng.calibrate_bases(self.engine, self.pipe, lambda: self.logprobs(self.calibration_batch()))
        self.wire.take()
        self.start = self._load_checkpoint() if resume else 0
        self.control, control_error = None, ""   # the controller lives on rank 0; the others follow its broadcasts
        if self.rank0:
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "config.yaml").write_text(to_yaml(self.tc) + "deepspeed: " + json.dumps(run.ds) + "\n")
            self.sampler = HFSampler(model_dir, self.tc.model.attn_implementation)
            self.shapes = self.sampler.state_shapes()
            self.logger = RunLogger(run_dir, {"twocircuit": to_plain(self.tc), **run.ds},
                                    self.tc.log.wandb, self.tc.log.project, self.start + 1 if resume else None)
            # a dense step's gap is the backend's alone: the codec's gap trend skips it
            self.trends = {"rollout_corr/kl_slope": Trend("rollout_corr/kl", skip="train/dense_step"),
                           "probe/kl_slope": Trend("probe/actor/kl_loss")}
            self.control = DriftController(self.tc.control, self.tc.grpo.kl_coef) if self.tc.control.enabled else None
            logged = self.logger.rows()
            for old in logged:   # a resumed run continues its windows (and the controller)
                for t in self.trends.values():
                    t.update(old)
            if self.control:
                control_error = self.control.replay(logged, self.start)
        if self.tc.control.enabled:
            self.share_kl_coef(control_error)
        self.correction = eng.SignCorrection(self.engine, self.pipe, self.tc.anchor.alpha)
        self.anchor = None
        if self.tc.anchor.enabled:
            anchor_cfg = {"train_micro_batch_size_per_gpu": self.micro, "optimizer": run.ds.get("optimizer"),
                          "twocircuit": to_plain(self.tc)}
            self.anchor = AnchorLink(self.tc, run_dir, self.engine, self.pipe, self.correction,
                                     json.dumps(anchor_cfg, indent=1), self.shapes if self.rank0 else None)
        if resume:
            self.sync_sampler()

    # ---- the run ----------------------------------------------------------------------------
    def run(self) -> None:
        steps = self.tc.train.steps
        if self.start == 0:
            self.evaluate(0)
        for t in tqdm(range(self.start, steps), desc="grpo", initial=self.start, total=steps, disable=not self.rank0):
            row = self.step(t)
            if self.rank0:
                for key, trend in self.trends.items():
                    slope = trend.update(row)
                    if slope is not None:
                        row[key] = slope
                if self.control:
                    row.update(self.control.update(row))
                self.logger.log(row)
            if self.tc.control.enabled and self.probe_step(t):
                self.share_kl_coef()
            done = t + 1
            if done % self.tc.train.eval_every == 0 or done == steps:
                self.evaluate(done)
            if (self.tc.train.save_every and done % self.tc.train.save_every == 0) or done == steps:
                self.save_checkpoint(done)
        self.export_hf(self.run_dir / "model")
        if self.anchor:
            self.anchor.close()
        if self.rank0:
            self.logger.close()

    def step(self, t: int) -> dict:
        t0 = time.perf_counter()
        rollout = self.rollout(t)
        t1 = time.perf_counter()
        anchor = {}
        if self.anchor:
            if self.rank0:
                self.anchor.ship(t, dict(self.sampler.model.named_parameters()), rollout, self.loss.coefs.kl_coef)
            anchor = self.anchor.adopt(t)
        t2 = time.perf_counter()
        mine = self.dp_slice(rollout)
        probe = self.probe(mine) if self.probe_step(t) else None
        dense_step = bool(self.tc.train.dense_every) and (t + 1) % self.tc.train.dense_every == 0
        if self.tc.control.enabled:   # the controller's dense steps: rank 0 decides, every rank follows
            flag = torch.tensor([int(self.control.dense_next()) if self.rank0 else 0])
            dist.broadcast(flag, src=0)
            dense_step = dense_step or bool(flag)
        self.codec.enabled = not dense_step   # dense step injection: every pass of this step uncompressed
        try:
            metrics = self.update(t, mine, probe)
        finally:
            self.codec.enabled = True
        metrics["train/dense_step"] = float(dense_step)
        metrics["actor/kl_coef"] = self.loss.coefs.kl_coef
        t3 = time.perf_counter()
        sync_bytes = self.sync_sampler()
        if self.anchor:
            self.anchor.collect()
        t4 = time.perf_counter()
        metrics.update(anchor)
        metrics.update({"timing/gen": t1 - t0, "timing/anchor": t2 - t1, "timing/train": t3 - t2,
                        "timing/sync": t4 - t3, "timing/step": t4 - t0, "sync/bytes": sync_bytes})
        return {"step": t + 1, **metrics}

    def probe_step(self, t: int) -> bool:
        return bool(self.tc.train.probe_every) and t % self.tc.train.probe_every == 0

    def share_kl_coef(self, error: str = "") -> None:
        """Every rank takes rank 0's controller β (the last stages compute the loss with it); NaN
        carries rank 0's error (a resume it cannot rebuild) so that every rank stops, not only rank 0."""
        beta = torch.tensor([self.control.beta if self.rank0 and not error else float("nan")], dtype=torch.float64)
        dist.broadcast(beta, src=0)
        if error or beta.isnan():
            raise ValueError(error or "rank 0 could not rebuild the drift controller (see rank 0's error)")
        self.loss.coefs = dataclasses.replace(self.loss.coefs, kl_coef=float(beta))

    # ---- sampling ---------------------------------------------------------------------------
    def prompt_rows(self, t: int) -> list[int]:
        """Rows of the training set for step t: consecutive slices of per-epoch permutations."""
        n, B = len(self.task.train), self.tc.grpo.prompts_per_step
        perms: dict[int, np.ndarray] = {}
        rows = []
        for i in range(t * B, (t + 1) * B):
            epoch, pos = divmod(i, n)
            if epoch not in perms:
                perms[epoch] = np.random.default_rng([self.tc.train.seed, epoch]).permutation(n)
            rows.append(int(perms[epoch][pos]))
        return rows

    def rollout(self, t: int) -> Rollout:
        """Rank 0 samples and scores; every rank receives the batch."""
        g = self.tc.grpo
        ts = None
        if self.rank0:
            rows = self.task.train.select(self.prompt_rows(t))
            torch.manual_seed(self.tc.train.seed * 1_000_003 + t)
            with all_threads():
                gen = self.sampler.generate([self.task.prompt(p) for p in rows["problem"]], g.group_size,
                                            max_new_tokens=g.max_new_tokens, temperature=g.temperature)
            answers = [a for a in rows["answer"] for _ in range(g.group_size)]
            rewards = torch.tensor([self.task.reward(x, a) for x, a in zip(gen.texts, answers)])
            ts = Rollout(gen.ids_NT, gen.attn_NT, gen.resp_NT1, gen.logp_NT1, rewards,
                         group_advantages(rewards, g.group_size, g.adv_eps),
                         torch.arange(len(answers))).tensors()
        return Rollout.from_tensors(eng.broadcast_tensors(ts, len(Rollout.__dataclass_fields__)))

    def dp_slice(self, r: Rollout) -> list[tuple[Rollout, float]]:
        """This replica's part of each PPO mini-batch, with the mini-batch's response-token count."""
        g, dp = self.tc.grpo, self.run_cfg.dp
        size = r.ids_NT.shape[0] // g.ppo_mini_batches
        rank = self.engine.grid.get_data_parallel_rank()
        out = []
        for m in range(g.ppo_mini_batches):
            mb = r.slice(m * size, (m + 1) * size)
            part = size // dp
            out.append((mb.slice(rank * part, (rank + 1) * part), mb.num_response_tokens))
        return out

    # ---- training ---------------------------------------------------------------------------
    def probe(self, minibatches: list[tuple[Rollout, float]]) -> dict:
        """Codec off, current weights, the step's first mini-batch: the dense log-probs of the
        sampled tokens (→ probe/rollout_corr/*, the mismatch without the codec's part) and of the
        reference (→ probe/actor/kl_loss, the true drift the controller reads, in every precision);
        in plain fp32 also the dense gradient, which the correction hook compares with the compressed
        and the corrected one (grad/cos_*), and the dense entropy. Its wire bytes are kept apart."""
        mb, ntok = minibatches[0]
        w = mb.resp_NT1 / max(ntok, 1.0)
        z = torch.zeros_like(mb.resp_NT1)
        self.codec.enabled = False
        try:
            self.reset_shape_if_changed(mb.ids_NT.shape[1])
            dense = self.logprobs(mb)
            ref = self.logprobs(mb, self.base)
            dense_view = {"actor/kl_loss": float((w * k3_kl(dense, ref)).sum())}   # the true drift
            if not self.correction.fragments():   # the dense gradient needs per-parameter .grad (fp32, no ZeRO)
                self.loss.reset()
                self.loss.mode, self.loss.old_is_current = "train", True
                self.loss.scale = self.engine.gradient_accumulation_steps() * self.run_cfg.dp
                eng.forward_backward(self.engine, eng.micro_batches(mb, self.micro, w, z, ref))
                self.correction.dense = {n: p.grad.detach().clone() for n, p in self.correction.named.items()}
                dense_view["actor/entropy"] = self.loss.sums["actor/entropy"]
                for p in self.pipe.parameters():
                    p.grad = None
        finally:
            self.codec.enabled = True
        fwd, _ = self.wire.take()
        self.codec.take_counters()
        sums = {**mismatch_sums(mb.sampler_logp_NT1, dense, w), **dense_view} if self.last_stage else {}
        keys = MISMATCH + (PROBE_VIEW if not self.correction.fragments() else ["actor/kl_loss"])
        return {"sums": sums, "bytes": fwd, "keys": keys}

    def update(self, t: int, minibatches: list[tuple[Rollout, float]], probe: dict | None = None) -> dict:
        """Every pass of step t (reference, old, each update) sees the same boundary masks: keyed by t."""
        g = self.tc.grpo
        self.codec.step = t
        self.reset_shape_if_changed(minibatches[0][0].ids_NT.shape[1])
        on_policy = g.ppo_mini_batches * g.ppo_epochs == 1
        zeros = [torch.zeros_like(mb.resp_NT1) for mb, _ in minibatches]
        refs = [self.logprobs(mb, self.base) for mb, _ in minibatches] if self.loss.coefs.kl_coef > 0 else zeros
        olds = zeros if on_policy else [self.logprobs(mb) for mb, _ in minibatches]
        eval_payload = self.codec.take_counters()
        self.loss.reset()
        self.loss.mode, self.loss.old_is_current = "train", on_policy
        self.loss.scale = self.engine.gradient_accumulation_steps() * self.run_cfg.dp
        norms = []
        for _ in range(g.ppo_epochs):
            for (mb, ntok), old, ref in zip(minibatches, olds, refs):
                w = mb.resp_NT1 / max(ntok, 1.0)
                self.engine.train_batch(iter(eng.micro_batches(mb, self.micro, w, old, ref)))
                self.correction.dense = None   # the probe's gradient is of the first mini-batch
                norms.append(self.engine.true_norm_clip.norm())
        if on_policy:
            olds = [torch.cat(self.loss.logps)] if self.last_stage else olds
        return self.reduce_metrics(minibatches, olds, norms, eval_payload, probe)

    def reset_shape_if_changed(self, seq_len: int) -> None:
        """DeepSpeed sizes its receive buffers from the first send (about 1 KB of shape metadata per
        cut) and reuses them; a step whose padded length (or codec on/off) differs must reset them on
        every rank."""
        key = (seq_len, self.codec.enabled)
        if key != self.wire_shape:
            self.engine.reset_activation_shape()
            self.wire_shape = key

    def logprobs(self, mb: Rollout, weights: list[torch.Tensor] | None = None) -> torch.Tensor:
        """log π(target) of every sequence through the pipeline (current or given weights), last stage."""
        self.loss.reset()
        self.loss.mode = "logprob"
        z = torch.zeros_like(mb.resp_NT1)
        data = iter(eng.micro_batches(mb, self.micro, z, z, z))
        n_micro = mb.ids_NT.shape[0] // self.micro
        if weights is None:
            self.engine.eval_batch(data, num_micro_batches=n_micro, bcast_loss=False)
        else:
            with eng.swapped_weights(self.pipe, weights):
                self.engine.eval_batch(data, num_micro_batches=n_micro, bcast_loss=False)
        self.loss.mode = "train"
        return torch.cat(self.loss.logps) if self.last_stage else z

    def reduce_metrics(self, minibatches, olds, norms, eval_payload, probe) -> dict:
        """Sum the last stages' token-mean sums over the world, finish the means on rank 0."""
        g = self.tc.grpo
        n_updates = g.ppo_mini_batches * g.ppo_epochs
        sums = {k: v / n_updates for k, v in self.loss.sums.items()}
        total = sum(ntok for _, ntok in minibatches)
        for (mb, _), old in zip(minibatches, olds):
            for k, v in mismatch_sums(mb.sampler_logp_NT1, old, mb.resp_NT1 / max(total, 1.0)).items():
                sums[k] = sums.get(k, 0.0) + v
        if probe is not None:
            sums.update({"probe/" + k: v for k, v in probe["sums"].items()})
        keys = sorted(KEYS) + (sorted("probe/" + k for k in probe["keys"]) if probe is not None else [])
        vec = torch.tensor([float(sums.get(k, 0.0)) if self.last_stage else 0.0 for k in keys], dtype=torch.float64)
        S = self.pipe.num_stages
        extra = torch.tensor([float(probe["bytes"]) if probe is not None else 0.0], dtype=torch.float64)
        vec = torch.cat([vec, self.correction.take_stats(), extra, self.weight_movement(), self.wire_vector(eval_payload)])
        dist.all_reduce(vec)
        out = dict(zip(keys, vec[:len(keys)].tolist()))
        if probe is not None:
            dense = finish_mismatch({k[6:]: out.pop(k) for k in list(out) if k.startswith("probe/")})
            out.update({"probe/" + k: v for k, v in dense.items()})
        out = finish_mismatch(out)
        i = len(keys)
        out.update(self.correction_metrics(vec[i:i + 7], probe is not None and not self.correction.fragments()))
        if probe is not None:
            out["probe/bytes_fwd"] = float(vec[i + 7])
        i += 8
        out.update(self.movement_metrics(vec[i:i + 4 * S]))
        out.update(self.wire_metrics(vec[i + 4 * S:]))
        rewards = torch.cat([mb.rewards_N for mb, _ in minibatches])
        lengths = torch.cat([mb.resp_NT1.sum(1) for mb, _ in minibatches])
        out.update({"critic/score/mean": float(rewards.mean()), "response_length/mean": float(lengths.mean()),
                    "actor/grad_norm": float(np.mean(norms)), "actor/lr": self.engine.get_lr()[0]})
        return out

    def correction_metrics(self, v: torch.Tensor, probed: bool) -> dict:
        """anchor/sign_agreement (when a sign is held) and, on probe steps, the gradient cosines."""
        agree, n, cd, cc, kd, kk, dd = v.tolist()
        out = {"anchor/sign_agreement": agree / n} if n > 0 else {}
        if probed and cc > 0 and dd > 0:
            out["grad/cos_comp_dense"] = cd / (cc * dd) ** 0.5
            out["grad/cos_corrected_dense"] = kd / (kk * dd) ** 0.5
        return out

    def wire_vector(self, eval_payload: tuple[int, int]) -> torch.Tensor:
        """Per stage: [p2p bytes fwd, p2p bytes bwd, payload, dense-equivalent payload (all passes),
        the same two for the update passes only] at this stage's slot."""
        v = torch.zeros(self.pipe.num_stages, 6, dtype=torch.float64)
        train_payload = self.codec.take_counters()
        v[self.pipe.stage_id] = torch.tensor([*self.wire.take(), eval_payload[0] + train_payload[0],
                                              eval_payload[1] + train_payload[1], *train_payload], dtype=torch.float64)
        return v.view(-1)

    def wire_metrics(self, v: torch.Tensor) -> dict:
        """Wire bytes per direction, and what a dense pipeline would have sent: the same sends with
        each compressed payload (and its gradient) at its dense size."""
        v = v.view(-1, 6)
        fwd, bwd, pay, dense_pay, pay_train, dense_train = v.sum(0).tolist()
        out = {"codec/bytes_fwd": fwd, "codec/bytes_bwd": bwd, "codec/dense_equiv_bytes": fwd - pay + dense_pay,
               "codec/dense_equiv_bytes_bwd": bwd - pay_train + dense_train}
        for b in range(self.pipe.num_stages - 1):
            out[f"codec/boundary{b}/bytes_fwd"] = float(v[b, 0])
            out[f"codec/boundary{b}/bytes_bwd"] = float(v[b + 1, 1])
        return out

    def calibration_batch(self) -> Rollout:
        """Teacher-forced training rows (prompt + answer), the same on every rank: lowrank's initial bases."""
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(self.model_dir)
        tok.padding_side = "left"
        n = self.micro * max(1, 64 // self.micro)
        rows = self.task.train.select(range(n))
        enc = tok([self.task.prompt(p) + a for p, a in zip(rows["problem"], rows["answer"])], return_tensors="pt",
                  padding=True, add_special_tokens=False)
        ids, attn = enc["input_ids"], enc["attention_mask"]
        z = torch.zeros(n, ids.shape[1] - 1)
        return Rollout(ids, attn, z, z, torch.zeros(n), torch.zeros(n), torch.arange(n))

    def weight_movement(self) -> torch.Tensor:
        """Per stage: [Σ(θ−θ0)², Σθ0², Σθ·θ0, Σθ²] at this stage's slot (data-parallel rank 0 only)."""
        v = torch.zeros(self.pipe.num_stages, 4, dtype=torch.float64)
        if self.engine.grid.get_data_parallel_rank() == 0:
            for p, b in zip(self.pipe.parameters(), self.base):
                p, b = p.detach().double(), b.double()
                v[self.pipe.stage_id] += torch.stack([(p - b).pow(2).sum(), b.pow(2).sum(), (p * b).sum(), p.pow(2).sum()])
        return v.view(-1)

    def movement_metrics(self, v: torch.Tensor) -> dict:
        v = v.view(-1, 4)
        out = {}
        for s, (d2, b2, pb, p2) in enumerate(v.tolist()):
            out[f"weights/rel_change/stage{s}"] = (d2 / b2) ** 0.5
            out[f"weights/cos_base/stage{s}"] = pb / (p2 * b2) ** 0.5
        return out

    # ---- sampler sync, evaluation, checkpoints, export --------------------------------------
    def sync_sampler(self) -> int:
        named, nbytes = eng.gather_stage_weights(self.engine, self.pipe, self.shapes if self.rank0 else None)
        if self.rank0:
            self.sampler.load_weights(named)
        return nbytes

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
        self.engine.save_checkpoint(str(self.run_dir / "checkpoints"), tag=f"step{done}", client_state={"step": done})

    def _load_checkpoint(self) -> int:
        ckpt = self.run_dir / "checkpoints"
        if not (ckpt / "latest").is_file():
            raise ValueError(f"--resume: no checkpoint under {ckpt}")
        _, client = self.engine.load_checkpoint(str(ckpt))
        return int(client["step"])

    def export_hf(self, out_dir: pathlib.Path) -> None:
        """The current weights as an HF checkpoint: one shard per stage, index and config by rank 0."""
        if self.engine.grid.get_data_parallel_rank() == 0:
            mine = self.pipe.hf_parameters()
            names = self.pipe.hf_names_per_stage()[self.pipe.stage_id]
            write_stage_shard(out_dir, self.pipe.stage_id, self.pipe.num_stages, {n: mine[n] for n in names})
        dist.barrier()
        if self.rank0:
            write_index(out_dir, self.pipe.hf_names_per_stage(), self.pipe.config, self.model_dir)


PROBE_VIEW = ["actor/kl_loss", "actor/entropy"]
MISMATCH = ["rollout_corr/kl", "rollout_corr/k3_kl", "rollout_corr/prob_diff_mean", "_ps", "_pt", "_ps2", "_pt2", "_pspt"]
KEYS = ["actor/pg_loss", "actor/kl_loss", "actor/ppo_kl", "actor/pg_clipfrac", "actor/pg_clipfrac_lower",
        "actor/pg_clipfrac_dual", "actor/entropy", "rollout_corr/kl", "rollout_corr/k3_kl",
        "rollout_corr/prob_diff_mean", "_ps", "_pt", "_ps2", "_pt2", "_pspt"]


class all_threads:
    """Use every core for rank 0's generation: the other ranks are idle in a collective meanwhile."""

    def __enter__(self):
        self.n = torch.get_num_threads()
        torch.set_num_threads(int(os.environ.get("DS_TWOCIRCUIT_GEN_THREADS", os.cpu_count() or 1)))

    def __exit__(self, *exc):
        torch.set_num_threads(self.n)


def to_plain(tc):
    from omegaconf import OmegaConf
    return OmegaConf.to_container(OmegaConf.structured(tc))
