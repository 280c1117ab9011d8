"""HF `generate` sampler on a dense copy of the current weights (the CPU default backend).

It samples from softmax(logits/τ) and nothing else, and records the log-probability of every
sampled token under that distribution, so the trainer can measure the train-inference mismatch;
greedy is the plain argmax. The model's own generation_config.json adds nothing: HF `generate`
fills every field a passed config leaves unset from `model.generation_config`, so a saved
repetition_penalty, min_p, no_repeat_ngram_size, suppress_tokens, ... would change the draws but
not the logged numbers; the sampler replaces the model's with a neutral one. Prompts are
left-padded; the response runs through the first of any of the model's EOS ids (`eos_ids`),
padding after.
"""
from typing import Mapping

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from . import Generation, eos_ids
from .reference import response_logprobs


class HFSampler:
    """The `Sampler` protocol on an HF model in this process on `device` (the rank's accelerator; the
    CPU by default): draws from softmax(logits/τ) alone, greedy by argmax, stops on every EOS id of
    the model. What it returns lives on the host, beside the rollout.

    It holds weights of `dtype` (what the weight stream sends) and computes in that dtype on an
    accelerator; on the CPU it computes in fp32 from them (bf16 values upcast exactly), since bf16
    matmuls there run about 10x slower on AVX2. A GPU's bf16 kernels add a sampler-trainer gap that
    the CPU's fp32 compute does not show."""

    def __init__(self, model_dir: str, attn_implementation: str = "sdpa", dtype: str = "float32", device=None):
        self.device = torch.device(device or "cpu")
        self.held = getattr(torch, dtype)
        compute = torch.float32 if self.device.type == "cpu" else self.held
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.tokenizer.padding_side = "left"
        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=compute, attn_implementation=attn_implementation).eval().to(self.device)
        if compute != self.held:
            with torch.no_grad():   # the values the held dtype can take
                for p in self.model.parameters():
                    p.copy_(p.to(self.held))
        self.eos_id = self.tokenizer.eos_token_id
        self.eos_ids = eos_ids(model_dir, self.tokenizer)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_id
        # `generate` fills what a passed config leaves unset from this one: neutral, it adds nothing
        self.model.generation_config = GenerationConfig(eos_token_id=self.eos_ids, pad_token_id=self.pad_id)

    @torch.no_grad()
    def load_weights(self, weights: Mapping[str, torch.Tensor], changed: set[str] | None = None) -> int:
        """Copies the changed tensors, rounded to the held dtype, into the model's own; → their bytes
        in the held dtype."""
        params, nbytes = dict(self.model.named_parameters()), 0
        for name, t in weights.items():
            if changed is None or name in changed:
                params[name].copy_(t.to(self.held))    # copy_ crosses devices and upcasts exactly
                nbytes += params[name].numel() * self.held.itemsize
        return nbytes

    def close(self) -> None:
        pass

    def weight_shapes(self) -> dict[str, tuple[torch.Size, torch.dtype]]:
        return {n: (p.shape, self.held) for n, p in self.model.named_parameters()}

    def held_weights(self) -> Mapping[str, torch.Tensor]:
        return {n: p.to(self.held) for n, p in self.model.named_parameters()}

    @torch.no_grad()
    def generate(self, prompts: list[str], n: int = 1, *, greedy: bool = False, max_new_tokens: int = 16,
                 temperature: float = 1.0, seed: int | None = None) -> Generation:
        """Each prompt repeated n times (adjacent). → Generation with N = len(prompts)·n rows."""
        if seed is not None:
            torch.manual_seed(seed)
        enc = self.tokenizer([p for p in prompts for _ in range(n)], return_tensors="pt", padding=True,
                             add_special_tokens=False)
        out = self.model.generate(**{k: v.to(self.device) for k, v in enc.items()},
                                  generation_config=self._config(greedy, max_new_tokens, temperature))
        P = enc["input_ids"].shape[1]
        tau = 1.0 if greedy else temperature
        logp_NR = torch.stack([   # one new token's logits at a time: never an fp32 (N, R, V) copy
            torch.log_softmax(z_NV.float() / tau, -1).gather(-1, g_N[:, None])[:, 0]
            for z_NV, g_N in zip(out.logits, out.sequences[:, P:].T)], 1).cpu()   # on the host once
        sequences = out.sequences.cpu()
        gen_NR = sequences[:, P:]
        is_eos = torch.isin(gen_NR, torch.tensor(self.eos_ids, dtype=torch.long)).long()
        resp_NR = (is_eos.cumsum(1) - is_eos) == 0            # through the first eos, inclusive
        pad = torch.zeros(gen_NR.shape[0], P - 1)
        texts = [self.tokenizer.decode(g[m], skip_special_tokens=True) for g, m in zip(gen_NR, resp_NR)]
        ids_NT = torch.where(torch.cat([torch.ones_like(enc["input_ids"], dtype=torch.bool), resp_NR], 1),
                             sequences, self.pad_id)
        return Generation(
            ids_NT=ids_NT,
            attn_NT=torch.cat([enc["attention_mask"], resp_NR.long()], 1),
            resp_NT1=torch.cat([pad, resp_NR.float()], 1),
            logp_NT1=torch.cat([pad, logp_NR * resp_NR], 1),
            texts=texts,
        )

    def score(self, ids_NT: torch.Tensor, attn_NT: torch.Tensor, resp_NT1: torch.Tensor,
              temperature: float) -> torch.Tensor:
        """The log-probs of given sequences' response tokens under softmax(logits/τ) at the weights held
        now, in one teacher-forced pass: (N, T−1) float32, 0 off the response. On the tokens this
        sampler drew with the same weights they equal `generate`'s to the order of float summation
        (one pass against a cached token at a time)."""
        return response_logprobs(self.model, ids_NT, attn_NT, resp_NT1, temperature, device=self.device)

    def _config(self, greedy: bool, max_new_tokens: int, temperature: float) -> GenerationConfig:
        """Only what we mean: no logits processor but the temperature (top_k=0, top_p=1 disable those)."""
        sample = {} if greedy else {"temperature": temperature, "top_k": 0, "top_p": 1.0}
        return GenerationConfig(do_sample=not greedy, max_new_tokens=max_new_tokens, eos_token_id=self.eos_ids,
                                pad_token_id=self.pad_id, return_dict_in_generate=True, output_logits=True, **sample)


def greedy_scores(sampler, prompts: list[str], answers: list[str], score, max_new_tokens: int,
                  batch: int = 512) -> list[float]:
    """Each held-out prompt's reward of its greedy answer, in order (dense view)."""
    out = []
    for i in range(0, len(prompts), batch):
        gen = sampler.generate(prompts[i:i + batch], 1, greedy=True, max_new_tokens=max_new_tokens)
        out += score(gen.texts, answers[i:i + batch])
    return out


def greedy_accuracy(sampler, prompts: list[str], answers: list[str], score, max_new_tokens: int,
                    batch: int = 512) -> float:
    """Held-out greedy mean@1 accuracy (dense view)."""
    return sum(greedy_scores(sampler, prompts, answers, score, max_new_tokens, batch)) / max(1, len(prompts))
