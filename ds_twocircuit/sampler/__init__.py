"""The sampler side of the fast circuit: generates with the full dense weights θ_t.

A backend implements `Sampler`: generate completions with their own per-token log-probs, take new
dense weights after every optimizer step. `hf.HFSampler` (HF `generate`, the CPU default) is the one
here; a vLLM backend implements the same two methods.
"""
from typing import Iterable, Protocol

import torch


class Sampler(Protocol):
    def generate(self, prompts: list[str], n: int, *, greedy: bool, max_new_tokens: int,
                 temperature: float) -> "Generation": ...

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None: ...


from .hf import Generation, HFSampler  # noqa: E402
