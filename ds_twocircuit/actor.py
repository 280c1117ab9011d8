"""The actor side of a step: the compressed pipeline, its base weights, and the two things it does
with a batch, the codec-off probe and the update.

Every rank holds one `Actor` over its own stage. The optimizer step's order (pipeline/step_order.py) is
installed here once: guard, clip, the probe's gradient comparison, the anchor's sign correction,
the comparison again. An update runs inside one step context (`stepping`) that keys the codec by
the step, counts the wire and the codec's payloads, arms the sign correction and the guard, and
yields what they counted.
"""
import contextlib
import dataclasses
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import torch

from .pipeline import passes, traffic, wire
from .metrics import telemetry
from .anchor.correction import Agreement, SignCorrection
from .codec.boundary import PayloadCount
from .pipeline.engine import Pipeline
from .pipeline.grads import GradientComparison, GradientViews, SteppedNorm
from .grpo.loss import LossCoefs, k3_kl
from .grpo.rollouts import Rollout, nonzero_advantage_rows
from .pipeline.guard import FiniteGuard, Verdict
from .grpo.rollout_correction import CORRECTION_SUMS, correction_sums, largest_weight
from .metrics.health import MISMATCH_SUMS, SPLIT_SUMS, STALENESS_SUMS, mismatch_split, mismatch_sums
from .pipeline.step_order import install_step_hooks
from .pipeline.wire import WireCount


@dataclass
class Probe:
    partials: dict[str, float]                 # probe/... sums (metrics/telemetry.py) and its forward bytes
    grads: dict[str, torch.Tensor] | None      # the dense gradient by HF name (per-parameter precision only)
    dense_logp: torch.Tensor | None = None     # the last stage's codec-off log-probs of the shard, (N, T−1)
    rescored_logp: torch.Tensor | None = None  # the sampler's log-probs of the shard at θ_t (sampler ahead), (N, T−1)


@dataclass
class StepCounts:
    """What one step's context counted: wire bytes, codec payloads, sign agreement, skipped steps."""
    wire: WireCount
    payload: PayloadCount              # the whole step's; `evals` holds the log-prob passes' part
    agreement: Agreement
    verdict: Verdict
    evals: PayloadCount = dataclasses.field(default_factory=PayloadCount)

    def train(self) -> PayloadCount:
        """The update passes' payloads: the step's less the log-prob passes' (integer bytes: exact)."""
        p, e = self.payload, self.evals
        return PayloadCount(p.payload - e.payload, p.dense - e.dense, p.grad - e.grad)


# loss-side sums that are diagnostics per token, not terms of the loss (see Actor._loss_sums)
PER_UPDATED_TOKEN = ("actor/kl_loss", "actor/ppo_kl", "actor/entropy", "actor/abs_log_ratio")


class Actor:
    def __init__(self, p: Pipeline, anchor_alpha: float | None):
        """`anchor_alpha`: the sign correction's α, None without an anchor (no correction hook)."""
        self.p = p
        self.base = [q.detach().clone() for q in p.pipe.parameters()]   # reference policy and θ_0
        self.guard = FiniteGuard(p.engine, p.pipe, p.loss, own_skip=p.per_param_grads)
        views = GradientViews(p.engine, p.pipe)
        self.compare = GradientComparison(views)
        self.stepped = SteppedNorm(views)
        self.correction = SignCorrection(views, anchor_alpha) if anchor_alpha is not None else None
        hooks = {"clip": p.clip.clip if p.clip.active else None, "stepped_norm": self.stepped.record,
                 "compare_before": self.compare.before,
                 "correct": self.correction.apply if self.correction else None, "compare_after": self.compare.after}
        install_step_hooks(p.engine.basic_optimizer, {k: f for k, f in hooks.items() if f is not None})

    @contextlib.contextmanager
    def stepping(self, t: int, sign: dict[str, torch.Tensor] | None):
        """Every pass of step t: the codec keyed by t, the wire and the codec's payloads counted, the
        sign correction applying `sign` (None: none held) and the guard deciding each optimizer step.
        Yields the StepCounts, filled as the passes run."""
        correcting = self.correction.applying(sign) if self.correction else contextlib.nullcontext(Agreement())
        with contextlib.ExitStack() as stack:
            stack.enter_context(self.p.codec.keyed(t))
            yield StepCounts(stack.enter_context(wire.counting()), stack.enter_context(self.p.codec.counting()),
                             stack.enter_context(correcting), stack.enter_context(self.guard.checking(t)))

    def probe(self, shard: tuple[Rollout, float], sampler_ref: torch.Tensor | None, coefs: LossCoefs,
              rescored: torch.Tensor | None = None) -> Probe:
        """Codec off, current weights, the step's first mini-batch: the dense log-probs of the
        sampled tokens (→ probe/rollout_corr/*, the mismatch without the codec's part) and of the
        reference (→ probe/actor/kl_loss, the true drift the controller reads, in every precision);
        with per-parameter gradients also the dense gradient, which the optimizer's hooks compare
        with the compressed and the corrected one (grad/cos_*), and the dense entropy. Its wire
        bytes are kept apart. The reference log-probs come from the sampler's rank when it sent them;
        `rescored`: with the sampler ahead, its log-probs of the shard's tokens at θ_t (on every rank),
        kept for the gap's split."""
        p, (mb, ntok) = self.p, shard
        w = mb.resp_NT1 / max(ntok, 1.0)
        grads, view = None, {}
        with p.codec.off(), wire.counting() as sent, traffic.boundary("boundary_probe"):
            dense = passes.logprobs(p, mb)
            ref = sampler_ref if sampler_ref is not None else passes.logprobs(p, mb, self.base)
            view["actor/kl_loss"] = float((w * k3_kl(dense, ref, w > 0)).sum())   # the true drift
            if p.per_param_grads:
                grads, sums = passes.dense_gradient(p, mb, ntok, ref, coefs)
                view["actor/entropy"] = sums.get("actor/entropy")   # the last stage's
        values = {**mismatch_sums(mb.sampler_logp_NT1, dense, w), **view} if p.last_stage else None
        partials = {"probe/" + k: v for k, v in telemetry.owned(MISMATCH_SUMS + list(view), values).items()}
        return Probe({**partials, "probe/_bytes_fwd": float(sent.fwd)}, grads, dense if p.last_stage else None,
                     rescored)

    def update(self, t: int, shards: list[tuple[Rollout, float]], probe: Probe | None, sampler_refs, kept,
               coefs: LossCoefs, sign, ppo_epochs: int) -> tuple[dict, float, Verdict]:
        """Every pass of step t (reference, old, each update) sees the same boundary masks: keyed by t.
        `sampler_refs`: each shard's reference log-probs from the sampler's rank (else a pipeline pass
        computes them); `kept`: with grpo.skip_zero_advantage, each mini-batch's response tokens of
        non-zero advantage, and only those sequences enter the passes (the loss keeps the whole
        mini-batch's token count, so the update is the same at β = 0); `sign`: the anchor's held
        sign(M), or None. → (this rank's metric partials, the mean gradient norm of its optimizer
        steps, which of them were skipped for non-finite values)."""
        p = self.p
        on_policy = len(shards) * ppo_epochs == 1
        rows0 = None      # the first shard's rows in the update, when some were left out (−1: pad)
        if kept is not None:
            picked = [nonzero_advantage_rows(mb, p.micro) for mb, _ in shards]
            rows0 = picked[0][1]
            shards = [(rows, ntok) for (rows, _), (_, ntok) in zip(picked, shards)]
        zeros = [torch.zeros_like(mb.resp_NT1) for mb, _ in shards]
        with self.stepping(t, sign) as counts, self.stepped.recording() as stepped_sq:
            with traffic.boundary("boundary_reference"):
                refs = zeros if coefs.kl_coef == 0 else sampler_refs if sampler_refs is not None else \
                    [passes.logprobs(p, mb, self.base) for mb, _ in shards]
            olds = zeros if on_policy else [passes.logprobs(p, mb) for mb, _ in shards]
            counts.evals = dataclasses.replace(counts.payload)
            updates, dots = [], None
            for _ in range(ppo_epochs):
                for (mb, ntok), old, ref in zip(shards, olds, refs):
                    # the probe's dense gradient is of the first mini-batch: compare the first update only
                    with self.compare.comparing(probe.grads if probe and dots is None else None) as d:
                        updates.append(passes.update(p, mb, ntok, old, ref, coefs, on_policy))
                    dots = dots or d
        if on_policy and p.last_stage:
            olds = [updates[0].old_logp]
        partials = self._partials(counts, updates, shards, kept, olds, on_policy, dots, coefs.kl_coef > 0)
        partials.update(telemetry.stepped_partials(stepped_sq, len(updates)))
        if coefs.correction is not None:
            partials.update(self._correction_partials(shards, kept, olds, coefs.correction))
        if probe is not None:
            partials.update(probe.partials)
            partials.update(self._split_partials(probe, shards, kept, olds, rows0))
        grad_norm = float("nan") if counts.verdict.skipped else float(np.mean([u.grad_norm for u in updates]))
        return partials, grad_norm, counts.verdict

    def _partials(self, counts: StepCounts, updates, shards, kept, olds, on_policy: bool, dots, kl: bool) -> dict:
        """This rank's metric partials of an update (metrics/telemetry.py sums them over ranks);
        `kl`: the loss has its KL term (β > 0), so actor/kl_loss is one of them."""
        p = self.p
        scale = [1.0] * len(shards) if kept is None else [ntok / k if k else 0.0 for (_, ntok), k in zip(shards, kept)]
        losses = [k for k in telemetry.LOSSES if kl or k != "actor/kl_loss"]
        partials = telemetry.owned(losses, _loss_sums(updates, scale) if p.last_stage else None)
        if not on_policy:
            first = {telemetry.FIRST_RATIO: updates[0].sums["actor/abs_log_ratio"] * scale[0]} if p.last_stage else None
            partials.update(telemetry.owned([telemetry.FIRST_RATIO], first))
        partials.update(telemetry.owned(MISMATCH_SUMS, _mismatch_sums(shards, kept, olds) if p.last_stage else None))
        partials.update(telemetry.correction_partials(counts.agreement, dots["before"], dots["after"]))
        partials.update(telemetry.movement_partials(p.pipe.parameters(), self.base, p.stage, p.num_stages,
                                                    counted=p.dp_rank == 0))
        w, whole, tr = counts.wire, counts.payload, counts.train()
        partials.update(telemetry.per_stage(telemetry.WIRE, p.stage, p.num_stages, "codec", [
            w.fwd, w.bwd, whole.payload, whole.dense, tr.grad, tr.dense, w.fwd_fp32, w.bwd_fp32]))
        partials.update(telemetry.owned(telemetry.SLOTS, _slots(updates) if p.stage == 0 else None))
        partials.update(telemetry.per_stage(["peak_rss_mib"], p.stage, p.num_stages, "memory",
                                            [telemetry.peak_rss_mib() if p.dp_rank == 0 else 0.0]))
        return partials

    def _correction_partials(self, shards, kept, olds, c) -> dict:
        """The rollout correction's sums over the tokens that entered the update (last stage) and each
        data-parallel replica's largest weight in its own slot (rollout_correction.py)."""
        p, values, largest = self.p, None, 0.0
        if p.last_stage:
            means = _token_means(shards, kept)
            values = defaultdict(float)
            for (mb, _), old, w in zip(shards, olds, means):
                for k, v in correction_sums(old, mb.sampler_logp_NT1, w, c).items():
                    values[k] += float(v)
                largest = max(largest, largest_weight(old, mb.sampler_logp_NT1, w > 0, c))
        out = telemetry.owned(CORRECTION_SUMS, values)
        out.update(telemetry.per_replica("rollout_corr/_is_max", p.dp_rank, p.dp, largest))
        return out

    def _split_partials(self, probe: Probe, shards, kept, olds, rows0) -> dict:
        """The first mini-batch's sampler–trainer gap by source (health.mismatch_split), on the tokens
        of it that entered the update: the probe's codec-off log-probs between the sampler's and π_old
        (and, with the sampler ahead, its log-probs at θ_t between its own and the probe's)."""
        values, rescored = None, probe.rescored_logp
        pick = (lambda x: x) if rows0 is None else (lambda x: x[rows0.clamp(min=0)])
        if self.p.last_stage:
            mb, ntok = shards[0]
            count = kept[0] if kept is not None else ntok       # the first mini-batch's updated tokens
            values = mismatch_split(mb.sampler_logp_NT1, pick(probe.dense_logp), olds[0], mb.resp_NT1 / max(count, 1.0),
                                    pick(rescored) if rescored is not None else None)
        return telemetry.owned(SPLIT_SUMS + (STALENESS_SUMS if rescored is not None else []), values)


def _token_means(shards, kept) -> list[torch.Tensor]:
    """Each shard's response tokens weighted 1 / (the tokens that entered the updates, over every
    mini-batch and replica: the kept ones' count when some were left out), so that the weights sum to
    1 over them."""
    counts = [ntok for _, ntok in shards] if kept is None else kept
    total = max(sum(counts), 1.0)
    return [mb.resp_NT1 / total for mb, _ in shards]


def _loss_sums(updates: list[passes.Update], scale: list[float]) -> dict[str, torch.Tensor]:
    """The token-mean sums of the step's updates, averaged over them; the diagnostics that are
    means per token (not terms of the loss) × `scale` of their mini-batch, which makes them means
    over the tokens that entered the update when some were left out."""
    total = defaultdict(lambda: torch.zeros(()))
    for i, u in enumerate(updates):
        for k, v in u.sums.items():
            total[k] = total[k] + (v * scale[i % len(scale)] if k in PER_UPDATED_TOKEN else v)
    return {k: v / len(updates) for k, v in total.items()}


def _slots(updates: list[passes.Update]) -> dict:
    """The update passes' token slots (counted once per replica, on its first stage): computed (rows
    × kept columns), what one padded length would have computed, and how many passes were trimmed
    (pipeline/layout.py)."""
    lays = [u.layout for u in updates]
    return dict(zip(telemetry.SLOTS, (sum(x.positions() for x in lays), sum(x.shape[0] * x.shape[1] for x in lays),
                                      sum(x.trimmed for x in lays))))


def _mismatch_sums(shards, kept, olds) -> dict:
    """Sampler vs trainer log-probs of the sampled tokens (π_old, the weights that sampled them)."""
    out = {}
    for (mb, _), old, w in zip(shards, olds, _token_means(shards, kept)):
        for k, v in mismatch_sums(mb.sampler_logp_NT1, old, w).items():
            out[k] = out.get(k, 0.0) + v
    return out
