"""The gradients the optimizer is about to step, by parameter name: their norm after the clip, and
the probe's comparison of them with the dense gradient of the same batch.

In plain fp32 the optimizer steps the parameters and each one's .grad is its gradient. Under bf16
and ZeRO-1 it steps flat fp32 partitions; DeepSpeed's `_hp_mapping` on each parameter says which
slice of which partition holds which of its elements (hp start, lp start, numel), so
`GradientViews` yields, for every parameter slice this rank's optimizer holds,

    (HF name, view of the gradient, offset of the view within the parameter, counted)

`counted` marks each coordinate once over the world, for statistics: not the tied head's copy on
the last stage, and in fp32 only on data-parallel rank 0 (the replicas hold the same all-reduced
gradient; partitions are each counted by their own replica). Hooks that read or rewrite gradients
are step pre-hooks on the optimizer that steps: they run after the clip (clip.py).
"""
import contextlib
from collections import defaultdict

import torch

TIED = "model.embed_tokens.weight"


class GradientViews:
    def __init__(self, engine, pipe):
        self.optimizer = engine.basic_optimizer
        self.named = pipe.hf_parameters_all()
        self.name_of = {id(p): n for n, p in self.named.items()}
        self.uncounted = {TIED} if pipe.stage_id > 0 and TIED in self.named else set()
        self.dp_rank = engine.grid.get_data_parallel_rank()
        self._fragments = None

    def _flat_fragments(self) -> dict[int, list]:
        """Flat partition (keyed by its storage) → [(name, hp start, lp start, numel)]; empty in fp32.
        By storage, not by group: ZeRO-1 steps one group at a time with `param_groups` swapped."""
        if self._fragments is None:
            self._fragments = defaultdict(list)
            for n, p in self.named.items():
                m = getattr(p, "_hp_mapping", None)
                if m is not None:
                    self._fragments[m.hp_fragment.untyped_storage().data_ptr()].append(
                        (n, m.hp_fragment_address.start, m.lp_fragment_address.start, m.lp_fragment_address.numel))
        return self._fragments

    def __iter__(self):
        frags = self._flat_fragments()
        for group in self.optimizer.param_groups:
            for flat in group["params"]:
                if flat.grad is None:
                    continue
                g = flat.grad.view(-1)
                key = flat.untyped_storage().data_ptr()
                if key in frags:
                    for name, hp, lp, n in frags[key]:
                        yield name, g.narrow(0, hp, n), lp, name not in self.uncounted
                elif id(flat) in self.name_of:
                    name = self.name_of[id(flat)]
                    yield name, g, 0, self.dp_rank == 0 and name not in self.uncounted


class GradientComparison:
    """Dot products of the stepped gradient with the probe's dense gradient d of the same batch,
    read before the sign correction (c = G_comp) and after it (k = the corrected G):

        before: c·d, c·c, d·d        after: k·d, k·k         (float64, counted coordinates only)
        grad/cos_comp_dense = c·d / √(c·c · d·d),  grad/cos_corrected_dense = k·d / √(k·k · d·d)

    `before` and `after` are two optimizer pre-hooks, registered around the correction's. They act
    only inside `comparing(dense)`, which yields the sums."""

    def __init__(self, views: GradientViews):
        self.views, self._dense, self._sums = views, None, None

    @contextlib.contextmanager
    def comparing(self, dense: dict[str, torch.Tensor] | None):
        """Within the block, compare the stepped gradient with `dense` (HF name → gradient); None: off.
        Yields {"before": [c·d, c·c, d·d], "after": [k·d, k·k]} (float64 tensors)."""
        self._dense = dense
        self._sums = {"before": torch.zeros(3, dtype=torch.float64), "after": torch.zeros(2, dtype=torch.float64)}
        try:
            yield self._sums
        finally:
            self._dense = None

    @torch.no_grad()
    def before(self) -> None:
        for name, g, lp, d in self._counted():
            gd = g.double()
            self._add("before", torch.stack([gd @ d, gd @ gd, d @ d]))

    @torch.no_grad()
    def after(self) -> None:
        for name, g, lp, d in self._counted():
            k = g.double()
            self._add("after", torch.stack([k @ d, k @ k]))

    def _add(self, key: str, v: torch.Tensor) -> None:
        """Sum on the gradients' device (the host zeros move there once)."""
        self._sums[key] = self._sums[key].to(v.device) + v

    def _counted(self):
        if self._dense is None:
            return
        for name, g, lp, counted in self.views:
            if counted:
                yield name, g, lp, self._dense[name].view(-1).narrow(0, lp, g.numel()).double()


class SteppedNorm:
    """Σ g² over this rank's counted coordinates of the gradient the optimizer steps, read after the
    clip (DeepSpeed's inside its step under bf16 and ZeRO-1, clip.py's in plain fp32) and before the
    sign correction: summed over ranks, the square of the clipped global norm, which a clip that
    binds makes max_norm (actor/grad_norm_clipped). One entry per optimizer step that ran."""

    def __init__(self, views: GradientViews):
        self.views, self._sq = views, None

    @contextlib.contextmanager
    def recording(self):
        """Within the block, each optimizer step appends its Σ g² (float64) to the yielded list."""
        self._sq = []
        try:
            yield self._sq
        finally:
            self._sq = None

    @torch.no_grad()
    def record(self) -> None:
        if self._sq is None:
            return
        sq = 0.0                     # a tensor on the gradients' device after the first
        for _, g, _, counted in self.views:
            if counted:
                gd = g.double()      # one float64 copy per tensor, no second temporary for g²
                sq = sq + gd @ gd
        self._sq.append(float(sq))
