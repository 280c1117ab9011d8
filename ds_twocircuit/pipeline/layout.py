"""How a pass's N sequences become DeepSpeed's micro-batches, one of two ways:

    padded    `micro` sequences at a time in batch order, every one as long as the batch (its longest
              prompt plus its longest response): one shape for the pass, so DeepSpeed sends its shape
              message once per cut and pass
    trimmed   the sequences sorted by the span of their real tokens, longest first (a shared-prompt
              group kept together, ordered by its longest), `micro` at a time, each micro-batch cut to
              the columns its rows span: padding no row needs is neither computed nor sent, but the
              shapes change, so DeepSpeed re-sends its shape message (1 KB) with every micro-batch
              on every cut (`dynamic_shape`)

`choose_layout` picks one (train.trim_micro_batches: auto | always | never); auto trims when the
bytes the trim saves on the cuts pay for those messages. With long-tailed responses (one sequence
of a step at the cap, most far shorter) the padded layout computes and sends mostly padding; with a
batch of like lengths a trim saves nothing worth a message.

Pure torch: the pipeline's passes (passes.py) and the projection (launch/projection.py) share it.
"""
from dataclasses import dataclass

import torch

SHAPE_MESSAGE = 1024   # bytes: DeepSpeed's tensor metadata (256 int32) per micro-batch and cut when shapes change


@dataclass(frozen=True)
class Layout:
    """A pass's micro-batches: the rows of the batch each holds (a slice or indices) and the columns
    [lo, hi) it keeps."""
    rows: list
    cols: list[tuple[int, int]]
    shape: tuple[int, int]           # the batch's (N, T)
    trimmed: bool                    # shapes differ between micro-batches (DeepSpeed's dynamic_shape)

    def positions(self) -> int:
        """Token slots the pipeline computes and sends: Σ rows × kept columns."""
        return sum(self.count(r) * (hi - lo) for r, (lo, hi) in zip(self.rows, self.cols))

    def count(self, rows) -> int:
        return len(range(self.shape[0])[rows]) if isinstance(rows, slice) else len(rows)


def padded_layout(N: int, T: int, micro: int) -> Layout:
    """`micro` rows at a time in batch order, every column."""
    return Layout([slice(i, i + micro) for i in range(0, N, micro)], [(0, T)] * -(-N // micro), (N, T), False)


def trimmed_layout(span_N2: torch.Tensor, T: int, micro: int, group: int = 1) -> Layout:
    """Rows by decreasing span length (ties in batch order), groups of `group` adjacent rows kept
    together and ordered by their longest row, `micro` rows a micro-batch, each cut to the columns
    [min first, max last + 1) of its rows. span_N2: each row's real tokens [first, last + 1)."""
    g = max(1, group)
    longest = (span_N2[:, 1] - span_N2[:, 0]).view(-1, g).amax(1)
    order = (torch.sort(longest, descending=True, stable=True).indices[:, None] * g + torch.arange(g, device=span_N2.device)).reshape(-1)
    rows = list(order.split(micro))
    return Layout(rows, [(int(span_N2[r, 0].min()), int(span_N2[r, 1].max())) for r in rows],
                  (span_N2.shape[0], T), True)


def choose_layout(span_N2: torch.Tensor, T: int, micro: int, group: int, cut_bytes: list[int], mode: str) -> Layout:
    """A batch's layout under `mode` (auto | always | never). auto trims when the bytes the trim
    saves on the cuts pay for DeepSpeed's shape messages:

        s = N·T − Σ_m rows_m · cols_m > 0   and   s · Σ_c b_c  ≥  M · n_cuts · SHAPE_MESSAGE

    b_c = `cut_bytes`[c], a token slot's bytes on cut c (forward and back: a training pass's); M
    micro-batches (a single stage has no cuts and trims whenever a slot is saved).
    A slot also costs compute on every stage, so where the bytes favour the padded layout the trim
    would have saved a few slots per micro-batch (1 KB / b_c: 3.3 at prf95's 308 bytes a training
    slot, 0.17 dense at d = 1536 in bf16)."""
    padded = padded_layout(span_N2.shape[0], T, micro)
    if mode == "never":
        return padded
    trimmed = trimmed_layout(span_N2, T, micro, group)
    saved = padded.positions() - trimmed.positions()
    pays = saved > 0 and saved * sum(cut_bytes) >= len(trimmed.rows) * len(cut_bytes) * SHAPE_MESSAGE
    return trimmed if mode == "always" or pays else padded


def long_tailed_spans(groups: int, group: int, mean: float, cap: int, prompt: tuple[int, int],
                      seed: int = 0) -> tuple[torch.Tensor, int, int]:
    """A GRPO batch's token spans with long-tailed responses, for benchmarks and the projection:
    `groups` prompts of uniform length in [prompt[0], prompt[1]] (left-padded to the longest, P
    columns), `group` samples each with a response length ~ log-normal(σ = 1, mean `mean`) cut to
    [1, cap] (most short, a few at the cap, as math reasoning's). → (span_N2, T, P), T = P + the
    longest response: what micro-batches of one padded length would hold."""
    g = torch.Generator().manual_seed(seed)
    lp = torch.randint(prompt[0], prompt[1] + 1, (groups,), generator=g).repeat_interleave(group)
    mu = torch.tensor(mean).log() - 0.5
    lr = (mu + torch.randn(groups * group, generator=g)).exp().round().clamp(1, cap).long()
    P = int(lp.max())
    T = P + int(lr.max())
    return torch.stack([P - lp, P + lr], 1), T, P
