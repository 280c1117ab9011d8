"""What each GPU of a launch holds at its peak, from the recipe and the model's shape, and the check
that refuses a placement leaving under 10 % of a device free, before any process group starts.

Arithmetic only (no torch): the trainer runs it on CUDA before the rendezvous, and
`launch/memory_plan.py` prints it, with its per-token costs measured instead where asked.

Notation: p parameters (of a stage, or the whole model for the samplers and the anchor), d hidden,
f MLP width, L layers, V vocabulary, h heads over kv key/value heads, a = 2 bytes in bf16/fp16 and
4 in fp32, t = micro × (max_prompt_len + max_new_tokens) tokens of a padded micro-batch, S stages,
m = gradient_accumulation_steps micro-batches a step, N = prompts_per_step × group_size samples,
T = max_prompt_len + R positions, R = max_new_tokens. GiB = 2^30 bytes.

  stage s of S (n layers)   training state   bf16/fp16: (2 + 2 + 4 + 12/z)·p  (weights and gradients
                                             in bf16, fp32 gradient accumulation; the fp32 master copy and
                                             Adam's two moments split over z = dp replicas by ZeRO-1 or
                                             DeepSpeed's bf16 optimizer, z = 1 otherwise); fp32:
                                             (4 + 4 + 8/z)·p
                            activations      checkpointing every k layers: min(S − s, m)·⌈n/k⌉·t·d·a
                                             (1F1B keeps S − s micro-batches in flight on stage s; one
                                             segment input each) plus one segment's forward and
                                             backward, k·t·c·a; without: min(S − s, m)·n·t·c·a
  the last stage, besides   chunked head     V·d·4 + 6.5·C (the head gradient's fp32 sum; a chunk's
                                             fp32 logits and its transients, grpo/logprobs.py; C = a
                                             chunk's logits, min(CHUNK, t·V·4))
  sampler, rank 0's GPU     vLLM             sampler.gpu_memory_utilization of the device
                            HF               p·w (w: sampler.dtype's bytes) + the KV cache
                                             2·L·N·T·kv·(d/h)·w + the logits `generate` keeps, one fp32
                                             (N, V) row per new token: R·N·V·4
  reference (grpo.ref_logprobs = sampler)    4·p + one forward of r = min(64, N) rows without
                                             gradients, r·T·(2d + 2f)·4, + 3·C
  anchor (fp32, no ZeRO)                     20·p (weights, gradient, base model, M, rebuilt θ) +
                                             L·t·d·4 + twice a stage's layer and head (fp32)

c = 6d + 4f values a token for one layer's saved activations and their gradients: at
Qwen2.5-Math-1.5B's shape in bf16 88 KiB a token, between the 70 and 105 KiB measured on a CPU at
1,024 and 2,048 positions (its attention materialises the scores; a GPU's flash kernel does not).
6.5·C matches the chunked head's 2.5 GiB measured there (python launch/bench_logprob_memory.py).
Not counted, and what the 10 % left free is for: CUDA's context and the allocator's slack (about
0.5 GiB a process), NCCL's buffers (1–2 GiB a process).
"""
from dataclasses import dataclass

from .deepspeed_keys import checkpoint_interval
from .schema import ConfigError, TwoCircuitConfig

GiB = 2 ** 30
CHUNK = 2 ** 28          # grpo/logprobs.py's CHUNK_BYTES: one chunk's fp32 logits
MIN_FREE = 0.10          # the share of a device a placement must leave free
REFERENCE_ROWS = 64      # sampler/reference.py's rows a forward


@dataclass(frozen=True)
class Shape:
    """A decoder-only model's shape, as its HF config.json names it."""
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    tie_word_embeddings: bool = True

    @classmethod
    def from_hf(cls, cfg: dict) -> "Shape":
        """From a config.json's keys (a multimodal one's `text_config` over its top level); key/value
        heads default to the heads (multi-head attention); another key missing is a ConfigError."""
        cfg = {**cfg, **cfg.get("text_config", {})}
        cfg.setdefault("num_key_value_heads", cfg.get("num_attention_heads"))
        missing = [k for k in cls.__dataclass_fields__ if k != "tie_word_embeddings" and cfg.get(k) is None]
        if missing:
            raise ConfigError(f"model.path: its config.json lacks {', '.join(missing)}, which the memory plan reads")
        return cls(**{k: cfg[k] for k in cls.__dataclass_fields__ if k in cfg})

    def layer_params(self) -> int:
        d, f, kv = self.hidden_size, self.intermediate_size, self.num_key_value_heads
        kv_d = kv * (d // self.num_attention_heads)
        return 2 * d * d + d + 2 * (d * kv_d + kv_d) + 3 * d * f + 2 * d   # q, o, k, v (biases), MLP, norms

    def params(self) -> int:
        heads = 1 if self.tie_word_embeddings else 2
        return self.num_hidden_layers * self.layer_params() + heads * self.vocab_size * self.hidden_size + self.hidden_size

    def layer_values_per_token(self) -> int:
        return 6 * self.hidden_size + 4 * self.intermediate_size


@dataclass(frozen=True)
class Process:
    """One process's share of a device: what it is, the setting that moves it (key=value), its parts in GiB."""
    name: str
    key: str
    parts: dict

    @property
    def gib(self) -> float:
        return sum(self.parts.values())


def stage_params(shape: Shape, split: list[int]) -> list[int]:
    """Parameters of each stage: its layers, the embedding on the first, the final norm and the
    (tied) head on the last."""
    embed, S = shape.vocab_size * shape.hidden_size, len(split)
    return [n * shape.layer_params() + (embed if s in (0, S - 1) else 0) + (shape.hidden_size if s == S - 1 else 0)
            for s, n in enumerate(split)]


def chunk(shape: Shape, tokens: int) -> int:
    """Bytes of one chunk's fp32 logits over `tokens` positions (at most CHUNK)."""
    return min(CHUNK, tokens * shape.vocab_size * 4)


def head_gib(shape: Shape, tokens: int) -> float:
    return (shape.vocab_size * shape.hidden_size * 4 + 6.5 * chunk(shape, tokens)) / GiB


def stage_process(tc: TwoCircuitConfig, ds: dict, shape: Shape, s: int, dp: int,
                  layer_bytes_per_token: float | None = None, head: float | None = None) -> Process:
    """Stage s's training process. `layer_bytes_per_token`, `head`: measured costs in place of the
    formulas (launch/memory_plan.py)."""
    split, S = tc.model.layers_per_stage, len(tc.model.layers_per_stage)
    half = any(ds.get(k, {}).get("enabled") for k in ("bf16", "fp16"))
    a = 2 if half else 4
    p = stage_params(shape, split)[s]
    z = dp if ds.get("zero_optimization", {}).get("stage", 0) >= 1 or ds.get("bf16", {}).get("enabled") else 1
    state = (8 + 12 / z if half else 8 + 8 / z) * p
    t = ds["train_micro_batch_size_per_gpu"] * (tc.data.max_prompt_len + tc.grpo.max_new_tokens)
    in_flight = min(S - s, ds.get("gradient_accumulation_steps") or S - s)
    layer = t * (layer_bytes_per_token or shape.layer_values_per_token() * a)
    k = checkpoint_interval(ds)
    if k:
        acts = {"checkpointed inputs": in_flight * -(-split[s] // k) * t * shape.hidden_size * a / GiB,
                "recomputed segment": min(k, split[s]) * layer / GiB}
    else:
        acts = {"activations": in_flight * split[s] * layer / GiB}
    parts = {"training state": state / GiB, **acts}
    if s == S - 1:
        parts["head"] = head_gib(shape, t) if head is None else head
    return Process(f"stage {s}", f"train_micro_batch_size_per_gpu={ds['train_micro_batch_size_per_gpu']}", parts)


def sampler_processes(tc: TwoCircuitConfig, shape: Shape, gpu_gib: float) -> list[Process]:
    """What sits beside stage 0 for the rollouts: the sampler and, where asked, the HF reference."""
    g, p = tc.grpo, shape.params()
    N, R = g.prompts_per_step * g.group_size, g.max_new_tokens
    T = tc.data.max_prompt_len + R
    if tc.sampler.backend == "vllm":
        out = [Process("the vLLM sampler", f"sampler.gpu_memory_utilization={tc.sampler.gpu_memory_utilization}",
                       {"sampler": tc.sampler.gpu_memory_utilization * gpu_gib})]
    else:
        w = 2 if tc.sampler.dtype == "bfloat16" else 4
        head_dim = shape.hidden_size // shape.num_attention_heads
        kv = 2 * shape.num_hidden_layers * N * T * shape.num_key_value_heads * head_dim * w
        out = [Process("the HF sampler", "sampler.backend=hf",
                       {"weights": p * w / GiB, "KV cache": kv / GiB, "kept logits": R * N * shape.vocab_size * 4 / GiB})]
    if g.ref_logprobs == "sampler":
        r = min(REFERENCE_ROWS, N)
        fwd = r * T * (2 * shape.hidden_size + 2 * shape.intermediate_size) * 4 + 3 * chunk(shape, r * T)
        out.append(Process("the HF reference", "grpo.ref_logprobs=sampler", {"weights": 4 * p / GiB, "forward": fwd / GiB}))
    return out


def anchor_process(tc: TwoCircuitConfig, ds: dict, shape: Shape, layer_bytes_per_token: float | None = None,
                   head: float | None = None) -> Process:
    t = ds["train_micro_batch_size_per_gpu"] * (tc.data.max_prompt_len + tc.grpo.max_new_tokens)
    layer = t * (2 * layer_bytes_per_token if layer_bytes_per_token else shape.layer_values_per_token() * 4)
    return Process("the anchor", f"anchor.device={tc.anchor.device}", {
        "training state": 20 * shape.params() / GiB,
        "checkpointed inputs": shape.num_hidden_layers * t * shape.hidden_size * 4 / GiB,
        "recomputed segment": layer / GiB, "head": 2 * (head_gib(shape, t) if head is None else head)})


def placement_plan(tc: TwoCircuitConfig, ds: dict, shape: Shape, world_size: int, local_size: int,
                   gpu_gib: float, visible: list[int] | None = None, **measured) -> dict[str, list[Process]]:
    """Each GPU's processes: "GPU i" for rank 0's node, by physical index, and "stage s's GPU" for a
    stage no rank of that node holds. Rank r holds stage r // dp (DeepSpeed's pipe-major topology) on
    its node's GPU visible[LOCAL_RANK] (the launcher's CUDA_VISIBLE_DEVICES, else 0, 1, ...); the
    sampler and the reference sit on rank 0's GPU, a managed anchor on `anchor.device` (-1: rank 0's)."""
    S = len(tc.model.layers_per_stage)
    dp = world_size // S
    visible = list(visible or range(local_size))
    local = min(local_size, world_size)
    plan = {f"GPU {visible[l]}": [stage_process(tc, ds, shape, l // dp, dp, **measured)] for l in range(local)}
    plan[f"GPU {visible[0]}"] += sampler_processes(tc, shape, gpu_gib)
    for s in range((local - 1) // dp + 1, S):
        plan[f"stage {s}'s GPU"] = [stage_process(tc, ds, shape, s, dp, **measured)]
    a = tc.anchor
    if a.enabled and not a.external:
        plan.setdefault(f"GPU {visible[0] if a.device < 0 else a.device}", []).append(
            anchor_process(tc, ds, shape, **measured))
    return plan


def crowded(plan: dict[str, list[Process]], gpu_gib: float) -> tuple[str, list[Process]] | None:
    """The first GPU whose processes leave under MIN_FREE of `gpu_gib` free, or None."""
    return next(((g, ps) for g, ps in plan.items() if sum(p.gib for p in ps) > (1 - MIN_FREE) * gpu_gib), None)


def refuse_crowded(plan: dict[str, list[Process]], gpu_gib: float) -> None:
    """Raise ConfigError in one line where a GPU would leave under 10 % free, naming the key to move:
    `anchor.device` where the anchor shares the GPU, else the largest process's key."""
    hit = crowded(plan, gpu_gib)
    if hit is None:
        return
    gpu, procs = hit
    total = sum(p.gib for p in procs)
    anchor = next((p for p in procs if p.key.startswith("anchor.device=")), None)
    names = ", ".join(p.name for p in procs)
    plan_line = (f"{gpu} would hold {names}: {total:.1f} of {gpu_gib:.0f} GiB by the memory plan, under "
                 f"{MIN_FREE * 100:.0f} % free for CUDA's contexts and NCCL's buffers")
    if anchor is not None and len(procs) > 1:
        raise ConfigError(f"{anchor.key}: {plan_line} (the anchor alone takes {anchor.gib:.1f}); "
                          "place it beside a light stage or on a GPU of its own (python launch/memory_plan.py "
                          "prints every GPU's plan)")
    big = max(procs, key=lambda p: p.gib)
    raise ConfigError(f"{big.key}: {plan_line} ({big.name} takes {big.gib:.1f}; python launch/memory_plan.py "
                      "prints every GPU's plan)")


def check_placement(run, gpu_gib: float, env: dict) -> None:
    """The trainer's check on CUDA, the same on every rank: `gpu_gib` one GPU's memory (every GPU of
    the launch taken as alike), the launcher's environment for the node's size and GPUs."""
    from .checks import model_config
    visible = [int(x) for x in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if x.strip().isdigit()] or None
    plan = placement_plan(run.tc, run.ds, Shape.from_hf(model_config(run.tc.model)), run.world_size,
                          int(env.get("LOCAL_SIZE", env.get("LOCAL_WORLD_SIZE", run.world_size))), gpu_gib, visible)
    refuse_crowded(plan, gpu_gib)
