"""The rollout batch: what the sampler produced for one step, in the trainer's coordinates.

Legend: N = B·G sequences (the G samples of a prompt adjacent), T = padded length (left-padded
prompt, right-padded response). "Target coordinates" (T−1 columns) index the predicted token:
column j is the log-probability of ids[:, j+1] given ids[:, :j+1], so logits of position j score
target j, and every per-token tensor below lives there.
"""
import dataclasses
from dataclasses import dataclass, fields
from typing import Collection

import torch


@dataclass
class Rollout:
    ids_NT: torch.Tensor           # int64 token ids
    attn_NT: torch.Tensor          # int64 1 on real tokens (prompt and response), 0 on padding
    resp_NT1: torch.Tensor         # float 1.0 on response targets (through the first eos), target coords
    sampler_logp_NT1: torch.Tensor # float sampler's log-prob of each response target (0 elsewhere)
    rewards_N: torch.Tensor        # float verifier rewards
    adv_N: torch.Tensor            # float group-normalised advantages
    sample_id_N: torch.Tensor      # int64 stable id of the sequence within the step's batch

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, f.name) for f in fields(self)]

    @classmethod
    def from_tensors(cls, ts: list[torch.Tensor]) -> "Rollout":
        return cls(*ts)

    def slice(self, start: int, stop: int) -> "Rollout":
        return Rollout(*[t[start:stop] for t in self.tensors()])

    def groups(self, idx: list[int], group_size: int) -> "Rollout":
        """The rows of prompt groups `idx` (G adjacent samples each), in that order."""
        return self.rows(torch.tensor([g * group_size + j for g in idx for j in range(group_size)], dtype=torch.long))

    def rows(self, idx: torch.Tensor) -> "Rollout":
        return Rollout(*[t[idx] for t in self.tensors()])

    @property
    def num_response_tokens(self) -> float:
        return float(self.resp_NT1.sum())


def response_lengths(r: Rollout, eos_ids: int | Collection[int], max_new_tokens: int) -> dict[str, float]:
    """verl's response_length/{mean,max,min,clip_ratio} of a batch (lengths count the eos token).
    A response is clipped when it used all `max_new_tokens` without producing any of `eos_ids` (one
    id or several: chat models name more than one); verl counts every response of full length, so
    one whose eos is its last allowed token counts there, not here."""
    len_N = r.resp_NT1.sum(1)
    cols = torch.arange(1, r.resp_NT1.shape[1] + 1, dtype=r.resp_NT1.dtype)
    last_N = (r.resp_NT1 * cols).argmax(1)                    # the last response target's column
    token_N = r.ids_NT.gather(1, (last_N + 1)[:, None])[:, 0]  # target column j is ids[:, j+1]
    eos = torch.tensor([eos_ids] if isinstance(eos_ids, int) else list(eos_ids), dtype=token_N.dtype)
    clipped_N = (len_N >= max_new_tokens) & ~torch.isin(token_N, eos)
    return {"response_length/mean": float(len_N.mean()), "response_length/max": float(len_N.max()),
            "response_length/min": float(len_N.min()), "response_length/clip_ratio": float(clipped_N.float().mean())}


def shard_slices(n: int, mini_batches: int, dp: int, dp_rank: int) -> list[slice]:
    """The rows of this data-parallel replica's part of each PPO mini-batch of an n-row batch."""
    size = n // mini_batches
    part = size // dp
    return [slice(m * size + dp_rank * part, m * size + (dp_rank + 1) * part) for m in range(mini_batches)]


def minibatch_shards(r: Rollout, mini_batches: int, dp: int, dp_rank: int) -> list[tuple[Rollout, float]]:
    """This data-parallel replica's part of each PPO mini-batch, with the whole mini-batch's
    response-token count (the token mean is over the mini-batch, not the shard)."""
    size = r.ids_NT.shape[0] // mini_batches
    return [(r.slice(s.start, s.stop), r.slice(m * size, (m + 1) * size).num_response_tokens)
            for m, s in enumerate(shard_slices(r.ids_NT.shape[0], mini_batches, dp, dp_rank))]


def nonzero_advantage_rows(r: Rollout, micro: int) -> tuple[Rollout, torch.Tensor]:
    """The sequences of `r` with a non-zero advantage, for an update that leaves the others out.

    Their count is padded up to a multiple of `micro` (at least one micro-batch: an optimizer step
    still runs) with copies of rows, cycled from the first kept one (from row 0 when none is kept,
    so whole groups stay whole when `micro` is a multiple of the group size), whose response mask
    is zeroed: the pad has weight 0 in the loss and every micro-batch keeps its shape.
    → (the rows, their indices in `r`: (n,), −1 for pad)."""
    keep = torch.nonzero(r.adv_N != 0).flatten()
    n = max(micro, -(-len(keep) // micro) * micro)
    idx = torch.cat([keep, torch.full((n - len(keep),), -1, dtype=torch.long)])
    source = keep if len(keep) else torch.arange(len(r.adv_N))
    rows = torch.where(idx < 0, source[torch.arange(n) % len(source)], idx)
    return dataclasses.replace(r.rows(rows), resp_NT1=torch.where((idx < 0)[:, None], 0.0, r.resp_NT1[rows])), idx


def nonzero_advantage_tokens(r: Rollout, mini_batches: int) -> list[float]:
    """Response tokens of each PPO mini-batch's sequences with a non-zero advantage (the whole
    mini-batch, every replica's part)."""
    size = r.ids_NT.shape[0] // mini_batches
    kept = r.resp_NT1 * (r.adv_N != 0)[:, None]
    return [float(kept[m * size:(m + 1) * size].sum()) for m in range(mini_batches)]
