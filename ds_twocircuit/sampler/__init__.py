"""The sampler side of the fast circuit: generates with the full dense weights θ_t.

A backend implements `Sampler`: generate completions with their own per-token log-probs, take new
dense weights after every optimizer step, and say which weights it holds (names, shapes, dtypes:
the trainer sizes its weight gather and checks the anchor's files by them). Two backends:
`hf.HFSampler` (HF `generate` in the trainer's process, the light default) and `vllm.VLLMSampler`
(a vLLM engine; vllm is imported there only). Importing this module pulls in torch only.

Both stop a response at the first of any of the model's EOS ids (`eos_ids`: chat models name
several, end-of-turn and end-of-text) and sample from softmax(logits / τ) alone, whatever sampling
fields the model's generation_config.json holds (repetition_penalty, min_p, ...).
"""
from dataclasses import dataclass
from typing import Mapping, Protocol

import torch


@dataclass
class Generation:
    ids_NT: torch.Tensor          # prompt (left-padded) + response (right-padded)
    attn_NT: torch.Tensor
    resp_NT1: torch.Tensor        # response targets, target coordinates (see grpo/rollouts.py)
    logp_NT1: torch.Tensor        # sampler log-probs of the response targets
    texts: list[str]              # decoded responses


class Sampler(Protocol):
    def generate(self, prompts: list[str], n: int = 1, *, greedy: bool = False, max_new_tokens: int = 16,
                 temperature: float = 1.0, seed: int | None = None) -> Generation:
        """Each prompt repeated n times (adjacent) → N = len(prompts)·n rows, with the log-probs of
        the sampled tokens under the distribution sampled from; `seed` makes the draws repeatable."""

    def load_weights(self, weights: Mapping[str, torch.Tensor], changed: set[str] | None = None) -> int:
        """Take new dense weights (HF name → tensor, all of them), in place; `changed` names those
        that differ from what it holds (None: all may); → the bytes taken in."""

    def weight_shapes(self) -> dict[str, tuple[torch.Size, torch.dtype]]:
        """HF name → (shape, dtype) of every weight it holds."""

    def held_weights(self) -> Mapping[str, torch.Tensor] | None:
        """The weights it holds, read back from itself (HF names); None where they cannot be."""

    def close(self) -> None:
        """Release what it started (engine processes)."""


def eos_ids(model_dir: str, tokenizer) -> list[int]:
    """Every id that ends a response: the tokenizer's eos, then the model's generation_config
    eos_token_id (an int or a list); without a generation_config.json, config.json's, as HF's
    loading falls back."""
    from transformers import AutoConfig, GenerationConfig
    try:
        named = GenerationConfig.from_pretrained(model_dir).eos_token_id
    except OSError:
        named = GenerationConfig.from_model_config(AutoConfig.from_pretrained(model_dir)).eos_token_id
    named = [named] if isinstance(named, int) else list(named or [])
    return [i for i in dict.fromkeys([tokenizer.eos_token_id, *named]) if i is not None]


def build_sampler(model_dir: str, tc, device=None) -> Sampler:
    """The configured backend (`sampler.*`) on the model at `model_dir`; the HF one on `device` (the
    rank's accelerator; the CPU by default; vLLM places itself)."""
    if tc.sampler.backend == "vllm":
        from .vllm import VLLMSampler
        return VLLMSampler(model_dir, tc.sampler, tc.data.max_prompt_len + tc.grpo.max_new_tokens, tc.train.seed)
    from .hf import HFSampler
    return HFSampler(model_dir, tc.model.attn_implementation, tc.sampler.dtype, device)
