"""The rollout side of a step: the task, the dense sampler, scoring, the reference log-probs beside
the sampler, and the held-out evaluation.

The sampler lives on global rank 0 beside stage 0; every rank holds a `RolloutSide`, and on the
others it holds nothing and only receives what rank 0 broadcasts (the batch, the reference
log-probs). Rank 0 uses every core while it generates: the other ranks are idle in the next
collective meanwhile. Everything random is keyed by (seed, step), so a resumed run replays the same
batches and samples.

With `rollout.staleness` = k > 0 the sampler runs in a process of its own (sampler/process.py) and
a step's batch is asked for ahead: batch j is generated from θ_max(0, j−k), the weights the sampler
holds after the sync that precedes the request (`request`), while the pipeline trains the steps
before it. The batches asked for and not yet trained on travel in the checkpoint (`ahead_state`),
so a resumed run trains on the same batches as the uninterrupted one. A probe step's batch t is also
scored again by the sampler at θ_t, the weights the step trains from (`request`'s `rescore`), which
separates the gap's staleness from the sampler's numerics (metrics/health.py, `mismatch_split`).
"""
import os
import time

import torch
import torch.distributed as dist

from .model.pipe import check_contiguous, mask_from_span, span_from_mask
from .pipeline import comm
from .pipeline.calibration import calibration_batch
from .run.faults import slow_point
from .data import build_task, step_rows
from .grpo.advantages import group_advantages
from .grpo.rollouts import Rollout
from .sampler import build_sampler
from .sampler.process import SamplerProcess
from .sampler.hf import greedy_scores
from .sampler.reference import ReferenceLogProbs, pack, unpack
from .sync.weight_sync import WeightSync, dump_for_tests


class RolloutSide:
    def __init__(self, tc, model_dir: str, tokenizer, sampling: bool):
        """`sampling`: this rank holds the task and the sampler (global rank 0)."""
        self.tc, self.tokenizer = tc, tokenizer
        self.task = build_task(tc.data, tokenizer) if sampling else None
        self.sampler = self.reference = None
        self.ahead: dict[int, int | Rollout] = {}   # step → the sampler's ticket, or the finished batch
        self.rescored: dict[int, int] = {}    # step → the ticket of its batch's rescoring at θ_step
        self.made_from: dict[int, int] = {}   # step → the θ its batch was generated from, as the child reported
        if sampling:
            for split, n in self.task.left_out.items():
                if n:
                    print(f"[data] {n} {split} rows left out: prompts over data.max_prompt_len="
                          f"{tc.data.max_prompt_len} tokens", flush=True)
            dev = comm.device()        # rank 0's accelerator: the HF sampler and the reference generate there
            self.sampler = (SamplerProcess(model_dir, tc, device=dev) if tc.rollout.staleness
                            else build_sampler(model_dir, tc, dev))
            self.reference = (ReferenceLogProbs(model_dir, tc.model.attn_implementation, device=dev)
                              if tc.grpo.ref_logprobs == "sampler" else None)

    def weight_shapes(self) -> dict | None:
        """HF name → (shape, dtype) of the sampler's whole model; None where there is no sampler."""
        return self.sampler.weight_shapes() if self.sampler is not None else None

    def calibration(self, micro: int) -> Rollout:
        """The lowrank codec's calibration batch (pipeline/calibration.py), on every rank."""
        ts = calibration_batch(self.tokenizer, self.task, micro).tensors() if self.task is not None else None
        return Rollout.from_tensors(comm.broadcast_tensors(ts, len(Rollout.__dataclass_fields__), host=True))

    def rollout(self, t: int, ends: tuple[int, ...], ends_group) -> tuple[Rollout, int]:
        """Step t's batch: rank 0 samples and scores, and sends each rank what it reads (device path,
        read on the host): every rank the masks (the attention's as spans), rewards, advantages and
        sample ids (shapes, the micro-batches, which sequences enter); the ranks in `ends` (the first
        and last stages) also the token ids and the sampler's log-probs. The other ranks hold zero-stride
        zero tensors of their shapes, which DeepSpeed never loads on a middle stage. → (the batch,
        the bytes the ranks received)."""
        r = self._sample(t) if self.task is not None else None
        every, tokens = (split_rollout(r) if r is not None else (None, None))
        meta = comm.broadcast_object((comm.shapes_of(every), comm.shapes_of(tokens)) if r is not None else None,
                                     kind="rollout")
        every = comm.broadcast_tensors(every, len(every or meta[0]), host=True, meta=meta[0], kind="rollout")
        if dist.get_rank() in ends:
            tokens = comm.broadcast_tensors(tokens, len(meta[1]), host=True, group=ends_group, meta=meta[1],
                                            kind="rollout")
        else:
            tokens = [torch.zeros((), dtype=dtype).expand(shape) for shape, dtype in meta[1]]
        sent = comm.nbytes(every) * (dist.get_world_size() - 1) + comm.nbytes(tokens) * (len(ends) - 1)
        return join_rollout(every, tokens), sent

    def _rows(self, t: int):
        """Step t's prompt rows (keyed by the seed and t)."""
        return self.task.train.select(step_rows(len(self.task.train), self.tc.grpo.prompts_per_step,
                                                self.tc.train.seed, t))

    def _request(self, rows, t: int):
        """The sampler's generate request for step t's rows: (args, kwargs)."""
        g = self.tc.grpo
        return ([self.task.prompt(p) for p in rows["problem"]], g.group_size), \
            dict(max_new_tokens=g.max_new_tokens, temperature=g.temperature, seed=self.tc.train.seed * 1_000_003 + t)

    def request(self, t: int, rescore: int | None = None) -> None:
        """Ask the sampler process for step t's batch now (rank 0, rollout.staleness > 0); it is
        generated after what was sent before, from the weights loaded last. Also past train.steps: a
        run resumed with more steps must find those batches made from the weights a longer run
        would have made them from (the last k + 1 generations of a run are spent on that).
        `rescore`: a step whose batch the sampler scores first, at the weights loaded last (step
        t − k, asked right after the sync that loaded θ_{t−k}; its batch is waited for, which its step
        would do next anyway)."""
        if self.sampler is None:
            return
        if rescore is not None and rescore not in self.rescored:
            r = self._finished(rescore)
            self.rescored[rescore] = self.sampler.submit("score", r.ids_NT, r.attn_NT, r.resp_NT1,
                                                         self.tc.grpo.temperature)
        if t not in self.ahead:
            args, kwargs = self._request(self._rows(t), t)
            self.ahead[t] = self.sampler.submit("generate", *args, **kwargs)

    def _finished(self, t: int) -> Rollout:
        """Step t's batch from the sampler process, scored (waited for once, then kept)."""
        if not isinstance(self.ahead[t], Rollout):
            gen, self.made_from[t] = self.sampler.answer(self.ahead[t])
            self.ahead[t] = self._finish(self._rows(t), gen)
        return self.ahead[t]

    def staleness(self, t: int) -> int:
        """Rank 0, rollout.staleness > 0, step t's batch taken: t minus the step whose weights the
        sampler process held when it generated it (what it reported, not what the schedule meant)."""
        return t - self.made_from.pop(t)

    def ahead_state(self) -> dict:
        """The batches asked for and not yet trained on, finished (scored), and the weights each came
        from, for the checkpoint: {"batches": {step: the Rollout's tensors}, "made_from": {step: the
        θ's step}}; {} off rank 0 or with rollout.staleness = 0. A rescoring in flight is not kept:
        the resumed run asks for it again at init, at the same θ_start."""
        if not self.ahead:
            return {}
        batches = {t: self._finished(t).tensors() for t in sorted(self.ahead)}
        return {"batches": batches, "made_from": {t: self.made_from[t] for t in batches}}

    def restore_ahead(self, state: dict) -> None:
        """What `ahead_state` saved, as this run's batches of those steps (rank 0, with
        rollout.staleness > 0: the other replicas of stage 0 read the same checkpoint file, and hold no
        sampler; a run resumed at k = 0 generates each step's batch anew)."""
        if self.sampler is not None and self.tc.rollout.staleness and state:
            if "batches" not in state:     # the first format, batches alone: their weights as scheduled
                k = self.tc.rollout.staleness
                state = {"batches": state, "made_from": {t: max(0, int(t) - k) for t in state}}
            self.ahead.update({int(t): Rollout.from_tensors(ts) for t, ts in state["batches"].items()})
            self.made_from.update({int(t): int(v) for t, v in state["made_from"].items()})

    def _rescored(self, t: int) -> torch.Tensor:
        """Step t's rescoring, checked to be at θ_t by the tag of the weights the child held."""
        logp, held = self.sampler.answer(self.rescored.pop(t))
        if held != t:
            raise RuntimeError(f"the sampler process rescored step {t}'s batch at the weights of step {held}")
        return logp

    def _sample(self, t: int) -> Rollout:
        slow_point("sample", t)
        if self.tc.rollout.staleness:
            self._finished(t)
            return self.ahead.pop(t)
        rows = self._rows(t)
        args, kwargs = self._request(rows, t)
        with all_threads():
            gen = self.sampler.generate(*args, **kwargs)
        return self._finish(rows, gen)

    def _finish(self, rows, gen) -> Rollout:
        """A step's generation for its `rows` scored: rewards, group advantages, sample ids."""
        g = self.tc.grpo
        answers = [a for a in rows["answer"] for _ in range(g.group_size)]
        rewards = torch.tensor(self.task.score(gen.texts, answers))
        return Rollout(gen.ids_NT, gen.attn_NT, gen.resp_NT1, gen.logp_NT1, rewards,
                       group_advantages(rewards, g.group_size, g.adv_eps), torch.arange(len(answers)))

    def reference_logprobs(self, r: Rollout, needed: bool) -> torch.Tensor | None:
        """With grpo.ref_logprobs = sampler and `needed` (a pass of the step reads them): rank 0's dense
        base model's log π_ref of the batch's response tokens, (N, T−1), on every rank; only the
        response tokens' floats are broadcast. None otherwise (the pipeline computes them, or nothing reads them)."""
        if self.tc.grpo.ref_logprobs != "sampler" or not needed:
            return None
        values = None
        if self.reference is not None:
            with all_threads():
                values = self.reference(r.ids_NT, r.attn_NT, r.resp_NT1, self.tc.grpo.temperature)
        return to_every_rank(values, r.resp_NT1)

    def rescored_logprobs(self, r: Rollout, t: int, needed: bool) -> torch.Tensor | None:
        """With rollout.staleness > 0 and `needed` (a probe step): the sampler's log-probs of step t's
        sampled tokens at θ_t (`request`'s rescore), (N, T−1), on every rank; only the response tokens'
        floats are broadcast. None otherwise."""
        if not self.tc.rollout.staleness or not needed:
            return None
        return to_every_rank(self._rescored(t) if self.sampler is not None else None, r.resp_NT1, "boundary_probe")

    def sync(self, weight_sync: WeightSync, ships: bool, step: int) -> tuple[dict | None, dict]:
        """The stages' weights, θ_step, to the sampler as deltas in its dtype (sync/weight_sync.py),
        every rank taking part (the sampler process's load is tagged with `step`); → (on rank 0: the
        sampler's weights, every tensor, when `ships` (the anchor takes them), else None; the sync's
        metrics: wire bytes and the changed fraction, the bytes the sampler took in and the seconds
        it took), (None, {}) elsewhere."""
        changed, row = weight_sync()
        if self.sampler is None:
            return None, {}
        t0 = time.perf_counter()
        tag = {"tag": step} if self.tc.rollout.staleness else {}
        row["sync/sampler_bytes"] = self.sampler.load_weights(weight_sync.mirror, changed, **tag)
        row["timing/sampler_load"] = time.perf_counter() - t0
        return (dict(weight_sync.mirror) if ships else None), row

    def evaluate(self) -> dict | None:
        """Held-out greedy accuracy with the sampler's dense weights: {"acc", "n", "scores"}, scores
        each prompt's 0/1 reward in order as a string of digits (what an interval over prompts
        resamples: notebooks/shares.py); None without a sampler."""
        if self.sampler is None:
            return None
        held = self.task.held_out
        with all_threads():
            scores = greedy_scores(self.sampler, [self.task.prompt(p) for p in held["problem"]], held["answer"],
                                   self.task.score, self.tc.grpo.max_new_tokens)
        binary = all(s in (0.0, 1.0) for s in scores)
        return {"acc": sum(scores) / max(1, len(held)), "n": len(held),
                "scores": "".join(str(int(s)) for s in scores) if binary else scores}

    def close(self, mirror: dict) -> None:
        if self.sampler is None:
            return
        dump_for_tests(mirror, self.sampler)
        self.sampler.close()
        self.task.close()                          # math-verify's helper processes


class all_threads:
    """Use every core for rank 0's generation: the other ranks are idle in a collective meanwhile."""

    def __enter__(self):
        self.n = torch.get_num_threads()
        torch.set_num_threads(int(os.environ.get("DS_TWOCIRCUIT_GEN_THREADS", os.cpu_count() or 1)))

    def __exit__(self, *exc):
        torch.set_num_threads(self.n)


def to_every_rank(values_NT1: torch.Tensor | None, resp_NT1: torch.Tensor, kind: str = "reference") -> torch.Tensor:
    """Rank 0's per-token values of a batch, (N, T−1), on every rank's host, 0 off the response (the
    other ranks pass None): only the response tokens' floats cross, received on the device path and
    counted as `kind` (pipeline/traffic.py)."""
    flat = pack(values_NT1, resp_NT1) if values_NT1 is not None else \
        torch.empty(int((resp_NT1 > 0).sum()), device=comm.device())
    return unpack(comm.broadcast_(flat, host=True, kind=kind), resp_NT1)


TOKENS = ("ids_NT", "sampler_logp_NT1")   # read by the first stage (ids) and the last (targets, the sampler's log-probs)


def split_rollout(r: Rollout) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """→ (what every rank reads, what only the ends read), in field order. The attention mask travels
    to every rank as each row's span [first, last + 1), (N, 2), 16 bytes a sequence: every stage lays
    out a pass's micro-batches from it (pipeline/passes.py)."""
    check_contiguous(r.attn_NT)
    every = [getattr(r, f) for f in Rollout.__dataclass_fields__ if f not in TOKENS and f != "attn_NT"]
    return [*every, span_from_mask(r.attn_NT)], [getattr(r, f) for f in TOKENS]


def join_rollout(every: list[torch.Tensor], tokens: list[torch.Tensor]) -> Rollout:
    *rest, span_N2 = every
    parts = dict(zip(TOKENS, tokens))
    rest = iter(rest)
    fields = {f: parts[f] if f in parts else next(rest) for f in Rollout.__dataclass_fields__ if f != "attn_NT"}
    return Rollout(**fields, attn_NT=mask_from_span(span_N2, fields["resp_NT1"].shape[1] + 1))
