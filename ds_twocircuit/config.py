"""The run's configuration: DeepSpeed's JSON plus our `twocircuit` block.

A recipe is one DeepSpeed JSON file. DeepSpeed's own top-level keys are passed to DeepSpeed; the
`"twocircuit"` block is ours, typed by the dataclasses below, merged with `key=value` overrides from
the command line (OmegaConf dotlist) and validated strictly. Everything here runs before any process
group exists, so a wrong config fails in seconds with one line that names the key
(`ConfigError`). DeepSpeed silently ignores misspelled top-level keys; we check them against the
keys its source knows (`deepspeed_known_keys`).
"""
from __future__ import annotations

import ast
import difflib
import functools
import importlib.util
import json
import os
import pathlib
import re
from dataclasses import dataclass, field
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException


class ConfigError(ValueError):
    """A user's configuration mistake; the message names the key."""


@dataclass
class TinyModelConfig:
    """The embedded base model (used when `model.path` is empty): a small Qwen2 built locally."""
    hidden_size: int = 64
    num_layers: int = 28            # 28 so the 4/4/4/4/3/3/3/3 layout of the 1.5B recipe is real
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 0      # MLP width; 0: 4 × hidden_size
    warmup_steps: int = 750         # supervised warm-start on the synthetic task (~0.35 held-out acc)
    warmup_batch: int = 128
    warmup_lr: float = 1e-3
    seed: int = 0


@dataclass
class ModelConfig:
    path: str = ""                  # HF directory or hub name; empty: the embedded small base model
    layers_per_stage: list[int] = field(default_factory=lambda: [4, 4, 4, 4, 3, 3, 3, 3])
    attn_implementation: str = "sdpa"
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)


@dataclass
class DataConfig:
    dataset: str = "synthetic"      # "synthetic", or a local .jsonl/.parquet path or hub name (MATH-style rows)
    split: str = "train"
    eval_dataset: str = ""          # held-out rows; empty: the synthetic held-out split / `eval_split`
    eval_split: str = "test"
    eval_size: int = 512
    problem_key: str = "problem"
    answer_key: str = "answer"
    max_prompt_len: int = 1024


@dataclass
class GRPOConfig:
    prompts_per_step: int = 32      # B
    group_size: int = 8             # G
    max_new_tokens: int = 5
    temperature: float = 1.0
    clip_low: float = 0.2           # ε_low
    clip_high: float = 0.2          # ε_high (the seeds' "wider clipping" run: 0.28)
    clip_ratio_c: float = 3.0       # dual-clip bound for Â < 0
    kl_coef: float = 0.001          # β of the k3 KL to the reference
    adv_eps: float = 1e-6
    ppo_mini_batches: int = 1       # optimizer steps per rollout batch (per epoch)
    ppo_epochs: int = 1


@dataclass
class TrainConfig:
    steps: int = 100                # rollout iterations; one optimizer step each at ppo_mini_batches=1
    seed: int = 0
    eval_every: int = 20
    save_every: int = 50            # DeepSpeed checkpoint cadence (0: only at the end)
    dense_every: int = 0            # every N-th step runs with the codec off (the seeds: 50); 0: never
    probe_every: int = 10           # codec-off probe (dense log-probs and dense gradient) cadence; 0: off


@dataclass
class CodecConfig:
    name: str = "dense"             # dense (the byte-matched control) | prf | lowrank
    keep_ratio: float = 0.05        # k = round(keep_ratio · d): 77 of 1536
    keep: int = 0                   # explicit k (overrides keep_ratio when > 0)
    boundaries: Any = "all"         # "all" cuts, or a list of cut layers (decoder index the cut follows)
    payload_dtype: str = "fp32"     # fp32 | bf16 on the wire
    seed: int = 0                   # the PRF key's seed


@dataclass
class AnchorConfig:
    """The dense anchor circuit (SPEC S5): sign(M) from a separate process, applied to every gradient."""
    enabled: bool = False
    every: int = 20                 # c: fires at t = 0, c, 2c, ...
    staleness: int = 20             # K: fire t replays θ(max(0, t−K)) and the batch it generated
    forecast: bool = False          # replay at θ̂ = θ(t−K) + (K/c)(θ(t−K) − θ(t−K−c)) instead
    beta_m: float = 0.25            # M ← β_M·M + (1−β_M)·G_anc
    alpha: float = 0.25             # G = α·G_comp + (1−α)·|G_comp| ⊙ sign(M)
    mode: str = "sync"              # sync: wait for each fire's sign (reproducible) | async: newest published
    external: bool = False          # the user runs launch/anchor.py (any host); else rank 0 starts it
    mailbox: str = ""               # directory shared with the anchor; default <run_dir>/anchor
    timeout: float = 600.0          # sync: seconds to wait for a fire's sign before holding the last one
    max_restarts: int = 3           # a crashed managed anchor is restarted at most this often


@dataclass
class ControlConfig:
    """The drift controller (SPEC S7, control.py): β of the KL term and the rate of dense steps
    follow the probe's true drift."""
    enabled: bool = False
    target_slope: float = 0.002     # s*: allowed growth of the probe's dense KL to the reference, nats/token/step
    window: int = 4                 # probe readings in the slope (× train.probe_every steps)
    gain: float = 1.0               # change of ln β and ln rate per unit of relative slope error (clipped to ±1)
    kl_coef_min: float = 1e-4
    kl_coef_max: float = 1.0
    dense_rate_min: float = 0.02    # fraction of steps run with the codec off, and where it starts (the seeds' dense_every: 50)
    dense_rate_max: float = 0.5


@dataclass
class LogConfig:
    wandb: bool = True              # offline unless the user is logged in (or WANDB_MODE says otherwise)
    project: str = "ds_twocircuit"


@dataclass
class TwoCircuitConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    codec: CodecConfig = field(default_factory=CodecConfig)
    anchor: AnchorConfig = field(default_factory=AnchorConfig)
    control: ControlConfig = field(default_factory=ControlConfig)
    log: LogConfig = field(default_factory=LogConfig)


CODECS = ("dense", "prf", "lowrank")


@dataclass
class RunConfig:
    """What `launch/train.py` runs: our typed block and DeepSpeed's dict, both validated."""
    tc: TwoCircuitConfig
    ds: dict
    world_size: int

    @property
    def num_stages(self) -> int:
        return len(self.tc.model.layers_per_stage)

    @property
    def dp(self) -> int:
        return self.world_size // self.num_stages


def load_config(ds_config_path: str, overrides: list[str] = (), world_size: int | None = None) -> RunConfig:
    """Read the JSON, apply dotlist overrides, validate everything. Raises ConfigError."""
    path = pathlib.Path(ds_config_path)
    if not path.is_file():
        raise ConfigError(f"--ds-config {ds_config_path}: no such file")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{ds_config_path}: not valid JSON ({e})") from None
    block = raw.pop("twocircuit", {})
    tc = merge_twocircuit(block, list(overrides))
    check_deepspeed_keys(raw)
    world_size = world_size or int(os.environ.get("WORLD_SIZE", "1"))
    run = RunConfig(tc=tc, ds=raw, world_size=world_size)
    validate(run)
    return run


def load_or_exit(loader, *args, report: bool = True) -> RunConfig:
    """`loader(*args)` for an entry point: a ConfigError becomes one `config error:` line on stderr
    (when `report`, e.g. on rank 0 only) and exit status 2, before anything else starts."""
    import sys
    try:
        return loader(*args)
    except ConfigError as e:
        if report:
            print(f"config error: {e}", file=sys.stderr)
        sys.exit(2)


def load_recipe(ds_config_path: str, overrides: list[str] = ()) -> RunConfig:
    """`load_config` for a single process outside the trainer's world (the anchor, evaluation):
    validated as for one data-parallel replica of the recipe's pipeline."""
    try:
        block = json.loads(pathlib.Path(ds_config_path).read_text()).get("twocircuit", {})
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"--ds-config {ds_config_path}: {e}") from None
    n_stages = len(merge_twocircuit(block, list(overrides)).model.layers_per_stage)
    return load_config(ds_config_path, overrides, world_size=n_stages)


def merge_twocircuit(block: dict, overrides: list[str]) -> TwoCircuitConfig:
    schema = OmegaConf.structured(TwoCircuitConfig)
    try:
        merged = OmegaConf.merge(schema, OmegaConf.create(block), OmegaConf.from_dotlist(overrides))
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or ""
        raise ConfigError(f"twocircuit config: {_omegaconf_reason(e)}" + (f" (key '{key}')" if key else "")) from None
    return OmegaConf.to_object(merged)


def _omegaconf_reason(e: Exception) -> str:
    msg = str(e).splitlines()[0]
    if "not in struct" in msg or "Key '" in msg and "not" in msg:
        return f"unknown key: {msg}"
    return msg


def validate(run: RunConfig) -> None:
    """Cross-field checks: split vs layers vs world size, batch arithmetic, ranges."""
    tc, ds = run.tc, run.ds
    split = tc.model.layers_per_stage
    if not split or min(split) < 1:
        raise ConfigError(f"model.layers_per_stage={split}: every stage needs at least one decoder layer")
    n_layers = model_num_layers(tc.model)
    if sum(split) != n_layers:
        raise ConfigError(f"model.layers_per_stage={split} sums to {sum(split)} but the model has {n_layers} "
                          "decoder layers")
    if run.world_size % len(split):
        raise ConfigError(f"model.layers_per_stage has {len(split)} stages but the world size is "
                          f"{run.world_size} (it must be a multiple: stages x data-parallel replicas)")
    _check_codec(tc.codec, split, model_hidden_size(tc.model))
    _check_batches(run)
    g = tc.grpo
    if g.group_size < 2:
        raise ConfigError(f"grpo.group_size={g.group_size}: group-normalised advantages need at least 2 samples")
    if g.temperature <= 0:
        raise ConfigError(f"grpo.temperature={g.temperature}: must be > 0")
    for key in ("steps", "eval_every"):
        if getattr(tc.train, key) < 1:
            raise ConfigError(f"train.{key}={getattr(tc.train, key)}: must be >= 1")
    if tc.train.dense_every < 0:
        raise ConfigError(f"train.dense_every={tc.train.dense_every}: must be >= 0 (0: never)")
    if tc.train.probe_every < 0:
        raise ConfigError(f"train.probe_every={tc.train.probe_every}: must be >= 0 (0: no probe)")
    _check_anchor(tc.anchor)
    _check_control(tc)
    if ds.get("zero_optimization", {}).get("stage", 0) > 1:
        raise ConfigError("zero_optimization.stage > 1: DeepSpeed's pipeline engine supports ZeRO stage 0 or 1")


def _check_codec(c: CodecConfig, split: list[int], d: int) -> None:
    if c.name not in CODECS:
        raise ConfigError(f"codec.name='{c.name}': expected one of {list(CODECS)}")
    k = codec_keep(c, d)
    if not 1 <= k <= d:
        raise ConfigError(f"codec.keep / codec.keep_ratio give k={k} channels but the model's hidden size is {d}")
    if c.payload_dtype not in ("fp32", "bf16"):
        raise ConfigError(f"codec.payload_dtype='{c.payload_dtype}': expected fp32 or bf16")
    cuts = codec_cuts(CodecConfig(), split)
    chosen = cuts if c.boundaries == "all" else c.boundaries
    if not isinstance(chosen, (list, tuple)) or any(b not in cuts for b in chosen):
        raise ConfigError(f"codec.boundaries={c.boundaries}: expected 'all' or a list of cut layers from {cuts}")


def _check_control(tc: TwoCircuitConfig) -> None:
    c = tc.control
    if not c.enabled:
        return
    if tc.train.probe_every < 1:
        raise ConfigError("control.enabled=true reads the codec-off probe: set train.probe_every >= 1")
    if tc.train.dense_every:
        raise ConfigError(f"train.dense_every={tc.train.dense_every}: with control.enabled=true the controller "
                          "decides which steps run dense; set train.dense_every=0")
    if not 0 < c.kl_coef_min <= tc.grpo.kl_coef <= c.kl_coef_max:
        raise ConfigError(f"grpo.kl_coef={tc.grpo.kl_coef}: the controller starts from it and needs "
                          f"0 < control.kl_coef_min ({c.kl_coef_min}) <= it <= control.kl_coef_max ({c.kl_coef_max})")
    if c.target_slope <= 0:
        raise ConfigError(f"control.target_slope={c.target_slope}: must be > 0")
    if c.window < 2:
        raise ConfigError(f"control.window={c.window}: a slope needs at least 2 probe readings")
    if not 0 < c.dense_rate_min <= c.dense_rate_max <= 1:
        raise ConfigError(f"control.dense_rate_min={c.dense_rate_min}, control.dense_rate_max={c.dense_rate_max}: "
                          "need 0 < min <= max <= 1")
    if c.gain <= 0:
        raise ConfigError(f"control.gain={c.gain}: must be > 0")


def _check_anchor(a: AnchorConfig) -> None:
    if a.every < 1:
        raise ConfigError(f"anchor.every={a.every}: must be >= 1")
    if a.staleness < 0:
        raise ConfigError(f"anchor.staleness={a.staleness}: must be >= 0")
    if not 0.0 <= a.alpha <= 1.0:
        raise ConfigError(f"anchor.alpha={a.alpha}: must be in [0, 1]")
    if not 0.0 <= a.beta_m < 1.0:
        raise ConfigError(f"anchor.beta_m={a.beta_m}: must be in [0, 1)")
    if a.mode not in ("sync", "async"):
        raise ConfigError(f"anchor.mode='{a.mode}': expected sync or async")
    if a.timeout <= 0:
        raise ConfigError(f"anchor.timeout={a.timeout}: must be > 0 seconds")


def codec_keep(c: CodecConfig, d: int) -> int:
    """k kept channels per token: `codec.keep` when set, else round(keep_ratio · d) (77 of 1536)."""
    return c.keep if c.keep > 0 else round(c.keep_ratio * d)


def codec_cuts(c: CodecConfig, split: list[int]) -> list[int]:
    """Compressed cuts as decoder-layer indices (the cut after stage s sits after its last layer)."""
    cuts = [sum(split[:i + 1]) - 1 for i in range(len(split) - 1)]
    return cuts if c.boundaries == "all" else list(c.boundaries)


def _check_batches(run: RunConfig) -> None:
    """rollout sequences = ppo_mini_batches × train_batch_size; train_batch_size = micro × gas × dp.

    Missing DeepSpeed batch keys are derived from the rollout size; given ones must agree."""
    g, ds = run.tc.grpo, run.ds
    rollout = g.prompts_per_step * g.group_size
    if rollout % g.ppo_mini_batches:
        raise ConfigError(f"grpo.ppo_mini_batches={g.ppo_mini_batches} does not divide the rollout batch "
                          f"(grpo.prompts_per_step x grpo.group_size = {rollout})")
    per_step = rollout // g.ppo_mini_batches
    micro = ds.get("train_micro_batch_size_per_gpu")
    if micro is None:
        raise ConfigError("train_micro_batch_size_per_gpu: missing from the DeepSpeed config")
    if per_step % (micro * run.dp):
        raise ConfigError(f"train_micro_batch_size_per_gpu={micro} x data-parallel {run.dp} does not divide "
                          f"the {per_step} sequences of one PPO mini-batch")
    gas = per_step // (micro * run.dp)
    if ds.setdefault("gradient_accumulation_steps", gas) != gas:
        raise ConfigError(f"gradient_accumulation_steps={ds['gradient_accumulation_steps']} but one PPO mini-batch "
                          f"of {per_step} sequences needs {gas} at micro-batch {micro} x data-parallel {run.dp}")
    if ds.setdefault("train_batch_size", per_step) != per_step:
        raise ConfigError(f"train_batch_size={ds['train_batch_size']} but one PPO mini-batch holds {per_step} "
                          "sequences (grpo.prompts_per_step x grpo.group_size / grpo.ppo_mini_batches)")


def model_num_layers(model: ModelConfig) -> int:
    """Decoder layer count, read from config.json without importing transformers."""
    return model.tiny.num_layers if not model.path else _hf_config_value(model, "num_hidden_layers")


def model_hidden_size(model: ModelConfig) -> int:
    return model.tiny.hidden_size if not model.path else _hf_config_value(model, "hidden_size")


def _hf_config_value(model: ModelConfig, key: str) -> int:
    cfg_file = pathlib.Path(model.path) / "config.json"
    if not cfg_file.is_file():
        try:  # a hub name already in the local cache
            from huggingface_hub import hf_hub_download
            cfg_file = pathlib.Path(hf_hub_download(model.path, "config.json"))
        except Exception as e:
            raise ConfigError(f"model.path='{model.path}': no config.json there or in the HF cache ({e})") from None
    cfg = json.loads(cfg_file.read_text())
    return cfg.get(key) or cfg["text_config"][key]


def check_deepspeed_keys(ds: dict) -> None:
    known = deepspeed_known_keys()
    for key in ds:
        if key not in known:
            near = difflib.get_close_matches(key, known, n=1)
            hint = f" (did you mean '{near[0]}'?)" if near else ""
            raise ConfigError(f"DeepSpeed config: unknown top-level key '{key}'{hint}; DeepSpeed would ignore it")


_KEY_RE = re.compile(r"^[a-z][a-z0-9_]*$")
_DS_DIRS = ("runtime", "monitor", "profiling", "elasticity", "compression", "nebula", "comm", "autotuning",
            "checkpoint", "utils", "inference")


@functools.lru_cache(maxsize=1)
def deepspeed_known_keys() -> frozenset[str]:
    """Every identifier-like string constant and config-model field in DeepSpeed's config code.

    Read from the installed source with `ast` (importing deepspeed costs seconds and starts an
    accelerator probe); a superset of the real top-level keys, so a typo is caught and no valid key
    is refused."""
    spec = importlib.util.find_spec("deepspeed")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("deepspeed is not installed")
    root = pathlib.Path(list(spec.submodule_search_locations)[0])
    keys: set[str] = set()
    for sub in _DS_DIRS:
        for path in (root / sub).rglob("*.py"):
            if "config" in path.name or "constants" in path.name:
                keys |= _string_keys(path)
    return frozenset(keys)


def _string_keys(path: pathlib.Path) -> set[str]:
    try:
        tree = ast.parse(path.read_text())
    except (SyntaxError, UnicodeDecodeError):
        return set()
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and _KEY_RE.match(node.value):
            out.add(node.value)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.add(node.target.id)
    return out


def to_yaml(tc: TwoCircuitConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(tc))
