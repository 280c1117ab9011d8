"""The vLLM sampler backend (`sampler.backend=vllm`): the only module that imports vllm.

One `vllm.LLM` engine on rank 0 (vLLM's default multi-process engine: an in-process one hung in
vLLM's distributed init inside a DeepSpeed job), kept for the whole run:

    generate      one request per prompt, n = G samples, seed (seed, step, prompt index), so a run
                  is repeatable and no prompt's draws depend on the batch beside it;
                  logprobs_mode="processed_logprobs": the log-prob of each sampled token under the
                  distribution actually sampled, softmax(logits / τ) (what π_old must be),
                  returned flat (`flat_logprobs`: one list of floats per sample, not a dict of
                  Logprob objects per token) and read as one slice per row
    load_weights  the trainer's dense weights, rounded to `sampler.dtype` and cast to the engine's
                  dtype (that one on GPUs; fp32 on the CPU, as the HF backend), as one safetensors blob
                  through `collective_rpc` to a worker extension (WorkerWeightLoader), which loads them in
                  place; then the prefix cache is reset (stale cached prefixes of prompts longer
                  than one KV block gave log-prob errors of 6.4 nats). A tied model is sent
                  `lm_head.weight` too: vLLM keeps its own copy of the head. Every tensor goes
                  whenever any changed: vLLM reloads layer by layer and processes a layer that got
                  only some of its tensors (q without k and v) with the rest missing. Only the
                  stages' deltas cross the network (sync/weight_sync.py); this handoff is on one host

Prompts are tokenized here (the trainer's tokenizer, no special tokens added) and passed as token
ids, so both backends see the same ids. The Generation it returns has the HF backend's layout:
prompts left-padded, responses right-padded to the longest, through the first of any of the
model's EOS ids (`eos_ids`: each request stops on every one). Explicit SamplingParams leave the
model's generation_config.json sampling fields unused (vLLM applies those only to requests that
come without any), so the draws are from softmax(logits / τ) alone, as in the HF backend.
"""
from typing import Mapping

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from . import Generation, eos_ids

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class WorkerWeightLoader:
    """vLLM worker extension (`LLM(worker_extension_cls=...)`): methods run inside vLLM's worker."""

    def load_safetensors(self, blob: bytes) -> int:
        """Load the named tensors of `blob` in place; → how many."""
        from vllm.platforms import current_platform
        weights = list(load_safetensors(blob).items())
        if current_platform.is_cpu():
            # oneDNN repacks linear weights at load, so model.load_weights finds no weight_loader:
            # the runner's reload path re-runs the repacking
            self.model_runner.reload_weights(weights_iterator=iter(weights))
        else:   # GPU-only path (the in-place loader TRL and verl use); not run on this project's CPUs
            self.model_runner.model.load_weights(weights=weights)
        return len(weights)


class VLLMSampler:
    """The `Sampler` protocol on a vLLM engine."""

    def __init__(self, model_dir: str, cfg, max_model_len: int, seed: int):
        """`cfg`: the `sampler` config section; `max_model_len`: the longest prompt + response (at
        most the model's positions)."""
        from vllm import LLM
        from vllm.platforms import current_platform
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.eos_id = self.tokenizer.eos_token_id
        self.eos_ids = eos_ids(model_dir, self.tokenizer)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_id
        config = AutoConfig.from_pretrained(model_dir)
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        self.dtype = DTYPES[cfg.dtype]
        with torch.device("meta"):
            meta = AutoModelForCausalLM.from_config(config)
        self.shapes = {n: (p.shape, self.dtype) for n, p in meta.named_parameters()}
        self.seed = seed
        cpu = self.cpu = current_platform.is_cpu()
        # on the CPU the engine computes in fp32 from the held dtype's values, as the HF backend does
        self.engine_dtype = torch.float32 if cpu else self.dtype
        kwargs = {"kv_cache_memory_bytes": int(cfg.kv_cache_gib * 2 ** 30)} if cpu else \
            {"gpu_memory_utilization": cfg.gpu_memory_utilization}   # GPU-only
        max_model_len = min(max_model_len, getattr(config, "max_position_embeddings", max_model_len))
        self.llm = LLM(model=model_dir, dtype=str(self.engine_dtype).removeprefix("torch."), seed=seed, max_model_len=max_model_len,
                       enforce_eager=cpu or cfg.enforce_eager, logprobs_mode="processed_logprobs",
                       worker_extension_cls=f"{__name__}.WorkerWeightLoader", **kwargs)

    def weight_shapes(self) -> dict[str, tuple[torch.Size, torch.dtype]]:
        return dict(self.shapes)

    def held_weights(self) -> None:
        """vLLM's CPU kernels repack linear weights at load: they cannot be read back in HF layout."""
        return None

    def load_weights(self, weights: Mapping[str, torch.Tensor], changed: set[str] | None = None) -> int:
        """All of `weights` when any changed, nothing otherwise; → the bytes handed to the engine."""
        if changed is not None and not changed:
            return 0
        tensors = {n: t.detach().to(self.dtype).to(self.engine_dtype).contiguous() for n, t in weights.items()}
        if self.tied and "lm_head.weight" not in tensors:
            # a copy: safetensors refuses tensors that share memory
            tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
        blob = save_safetensors(tensors)
        self.llm.collective_rpc("load_safetensors", args=(blob,))
        self.llm.reset_prefix_cache()
        return len(blob)

    def generate(self, prompts: list[str], n: int = 1, *, greedy: bool = False, max_new_tokens: int = 16,
                 temperature: float = 1.0, seed: int | None = None) -> Generation:
        """Each prompt repeated n times (adjacent). → Generation with N = len(prompts)·n rows."""
        from vllm import SamplingParams
        ids = [self.tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
        base = self.seed if seed is None else seed
        params = [SamplingParams(n=n, max_tokens=max_new_tokens, logprobs=0, flat_logprobs=True,
                                 stop_token_ids=list(self.eos_ids),
                                 **({"temperature": 0.0} if greedy else
                                    {"temperature": temperature, "top_k": 0, "top_p": 1.0,
                                     "seed": (base * 1_000_003 + i) % 2 ** 63}))
                  for i in range(len(prompts))]
        outs = []
        for group in self._groups([len(x) * n for x in ids]):
            outs += self.llm.generate([{"prompt_token_ids": ids[i]} for i in group], [params[i] for i in group],
                                      use_tqdm=False)
        rows = [(x, c) for x, o in zip(ids, outs) for c in o.outputs]
        return self._tensors(rows)

    def _groups(self, tokens: list[int]) -> list[list[int]]:
        """Consecutive prompt groups whose prefill fits one scheduler step, on CPU. vLLM 0.32's CPU
        sampler fails on a seeded request whose prefill is split across steps ("CPU Generator does
        not use offset", measured: 80 prompts x 8 samples of ~50 tokens against the 4096-token
        budget); elsewhere, one group. A prompt whose n samples alone exceed the budget stays alone."""
        budget = self.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens if self.cpu else None
        if budget is None:
            return [list(range(len(tokens)))]
        groups, used = [[]], 0
        for i, t in enumerate(tokens):
            if groups[-1] and used + t > budget:
                groups.append([])
                used = 0
            groups[-1].append(i)
            used += t
        return groups

    def _tensors(self, rows: list) -> Generation:
        """(prompt ids, vLLM CompletionOutput) per row → the padded Generation."""
        P = max(len(x) for x, _ in rows)
        R = max(len(c.token_ids) for _, c in rows)
        N = len(rows)
        ids_NT = torch.full((N, P + R), self.pad_id, dtype=torch.long)
        attn_NT = torch.zeros(N, P + R, dtype=torch.long)
        resp_NT1 = torch.zeros(N, P + R - 1)
        logp_NT1 = torch.zeros(N, P + R - 1)
        texts = []
        for i, (x, c) in enumerate(rows):
            r = _through_eos(list(c.token_ids), self.eos_ids)
            ids_NT[i, P - len(x):P] = torch.tensor(x)
            ids_NT[i, P:P + len(r)] = torch.tensor(r, dtype=torch.long)
            attn_NT[i, P - len(x):P + len(r)] = 1
            resp_NT1[i, P - 1:P - 1 + len(r)] = 1.0
            logp_NT1[i, P - 1:P - 1 + len(r)] = torch.tensor(sampled_logprobs(c.logprobs, r))
            texts.append(self.tokenizer.decode(r, skip_special_tokens=True))
        return Generation(ids_NT=ids_NT, attn_NT=attn_NT, resp_NT1=resp_NT1, logp_NT1=logp_NT1, texts=texts)

    def close(self) -> None:
        """Stop the engine's processes."""
        engine = getattr(self.llm, "llm_engine", None)
        if engine is not None and hasattr(engine, "engine_core"):
            engine.engine_core.shutdown()


def sampled_logprobs(flat, tokens: list[int]) -> list[float]:
    """The sampled tokens' log-probs from vLLM's FlatLogprobs of a sample drawn with logprobs=0 (one
    entry per position: the sampled token's), through len(tokens); checks they are those tokens'."""
    n = len(tokens)
    if n and (flat.token_ids[:n] != tokens or flat.end_indices[n - 1] != n):
        raise RuntimeError("vLLM returned log-probs of other tokens than the ones it sampled")
    return flat.logprobs[:n]


def _through_eos(tokens: list[int], eos_ids) -> list[int]:
    """`tokens` through the first of any id in `eos_ids`, inclusive (all of them if none occurs)."""
    return tokens[:next((i + 1 for i, t in enumerate(tokens) if t in eos_ids), len(tokens))]


