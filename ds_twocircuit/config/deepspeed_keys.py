"""DeepSpeed's top-level config keys, read off its installed source: DeepSpeed itself silently
ignores a misspelled top-level key, so we refuse any key its config code does not know.

Read with `ast`, not by importing deepspeed (which costs seconds and starts an accelerator probe):
every identifier-like string constant and config-model field name in DeepSpeed's config and
constants modules, a superset of the real top-level keys, so a typo is caught and no valid key is
refused.
"""
import ast
import difflib
import functools
import importlib.util
import pathlib
import re

from .schema import ConfigError

_KEY_RE = re.compile(r"^[a-z][a-z0-9_]*$")
_DS_DIRS = ("runtime", "monitor", "profiling", "elasticity", "compression", "nebula", "comm", "autotuning",
            "checkpoint", "utils", "inference")


def check_deepspeed_keys(ds: dict) -> None:
    known = deepspeed_known_keys()
    for key in ds:
        if key not in known:
            near = difflib.get_close_matches(key, known, n=1)
            hint = f" (did you mean '{near[0]}'?)" if near else ""
            raise ConfigError(f"DeepSpeed config: unknown top-level key '{key}'{hint}; DeepSpeed would ignore it")
    check_deepspeed_types(ds)


POSITIVE_INTS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size", "steps_per_print")
SECTIONS = ("bf16", "fp16", "zero_optimization", "optimizer", "scheduler", "pipeline", "wandb", "activation_checkpointing")


def check_deepspeed_types(ds: dict) -> None:
    """The types of the DeepSpeed keys this package reads or passes on, checked here because
    DeepSpeed checks them only inside `initialize`, after the process group exists."""
    for key in POSITIVE_INTS:
        v = ds.get(key, 1)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ConfigError(f"DeepSpeed config: {key}={v!r}: must be a positive integer")
    clip = ds.get("gradient_clipping", 1.0)
    if not isinstance(clip, (int, float)) or isinstance(clip, bool) or not 0 <= clip < float("inf"):
        raise ConfigError(f"DeepSpeed config: gradient_clipping={clip!r}: must be a number >= 0 (0: off)")
    for key in SECTIONS:
        if key in ds and not isinstance(ds[key], dict):
            raise ConfigError(f"DeepSpeed config: {key}={ds[key]!r}: must be a JSON object")
    for key in ("bf16", "fp16"):
        if not isinstance(ds.get(key, {}).get("enabled", False), bool):
            raise ConfigError(f"DeepSpeed config: {key}.enabled={ds[key]['enabled']!r}: must be true or false")
    stage = ds.get("zero_optimization", {}).get("stage", 0)
    if not isinstance(stage, int) or isinstance(stage, bool) or not 0 <= stage <= 3:
        raise ConfigError(f"DeepSpeed config: zero_optimization.stage={stage!r}: must be 0, 1, 2 or 3")
    if "optimizer" in ds and not isinstance(ds["optimizer"].get("type"), str):
        raise ConfigError(f"DeepSpeed config: optimizer.type={ds['optimizer'].get('type')!r}: must name an optimizer")
    accum = ds.get("data_types", {}).get("grad_accum_dtype")
    if bf16_with_zero(ds) and accum not in (None, "fp32"):
        raise ConfigError(f"DeepSpeed config: data_types.grad_accum_dtype={accum!r} with bf16 and "
                          f"zero_optimization.stage={stage}: gradients summed over hundreds of micro-batches in "
                          "half precision lose their small terms; use \"fp32\" (the default here)")


def bf16_with_zero(ds: dict) -> bool:
    return bool(ds.get("bf16", {}).get("enabled") and ds.get("zero_optimization", {}).get("stage", 0) > 0)


@functools.lru_cache(maxsize=1)
def deepspeed_known_keys() -> frozenset[str]:
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


# ---- the sections a user brings, each honored or refused -------------------------------------------
# pipeline: DeepSpeed's pipeline engine reads activation_checkpoint_interval and use_reentrant; the
# split is ours (model.layers_per_stage), and pipe_/grad_partitioned act only across tensor-parallel
# ranks, which this pipeline has none of (DeepSpeed's own engine ignores them then).
PIPELINE_KEYS = {"stages", "partition", "seed_layers", "activation_checkpoint_interval", "pipe_partitioned",
                 "grad_partitioned", "use_reentrant"}
# activation_checkpointing: these four act only on activations partitioned over tensor-parallel ranks
PARTITIONED_ONLY = ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization", "number_checkpoints")
CHECKPOINTING_KEYS = {*PARTITIONED_ONLY, "synchronize_checkpoint_boundary", "profile"}
MONITORS = {"tensorboard": "tensorboard", "csv_monitor": None, "comet": "comet_ml", "wandb": "wandb"}
# DeepSpeed's data pipeline: the trainer hands the engine its micro-batches itself (the step's
# rollouts), so DeepSpeed's dataloader, and what reshapes its batches, never runs
DATA_PIPELINE = ("curriculum_learning", "data_efficiency", "elasticity", "dataloader_drop_last")


def check_sections(ds: dict, n_stages: int, log_wandb: bool) -> None:
    """The `pipeline`, `activation_checkpointing` and monitor sections: each key does here what it
    reads as, or the config is refused naming it."""
    for key in DATA_PIPELINE:
        if key in ds:
            raise ConfigError(f"DeepSpeed config: {key}: acts on DeepSpeed's dataloader, which this trainer does not "
                              "use (each step's rollouts are its micro-batches); remove the key")
    pipe = ds.get("pipeline", {})
    _only_known("pipeline", pipe, PIPELINE_KEYS)
    if "partition" in pipe:
        raise ConfigError(f"DeepSpeed config: pipeline.partition={pipe['partition']!r}: the split is explicit here, "
                          "model.layers_per_stage (decoder layers per stage); remove the key")
    if pipe.get("stages", "auto") not in ("auto", n_stages):
        raise ConfigError(f"DeepSpeed config: pipeline.stages={pipe['stages']!r}, but model.layers_per_stage has "
                          f"{n_stages} stages")
    if pipe.get("seed_layers", False) is not False:
        raise ConfigError("DeepSpeed config: pipeline.seed_layers: the layers are loaded from the checkpoint and "
                          "draw no random numbers, so there is nothing to seed; remove the key")
    for key in ("pipe_partitioned", "grad_partitioned", "use_reentrant"):
        if not isinstance(pipe.get(key, True), bool):
            raise ConfigError(f"DeepSpeed config: pipeline.{key}={pipe[key]!r}: must be true or false")
    interval = pipe.get("activation_checkpoint_interval", 0)
    if not isinstance(interval, int) or isinstance(interval, bool) or interval < 0:
        raise ConfigError(f"DeepSpeed config: pipeline.activation_checkpoint_interval={interval!r}: must be an "
                          "integer >= 0 (decoder layers per recomputed segment; 0: off)")
    ckpt = ds.get("activation_checkpointing", {})
    _only_known("activation_checkpointing", ckpt, CHECKPOINTING_KEYS)
    for key in ckpt:
        if key in PARTITIONED_ONLY and ckpt[key] not in (False, None):
            raise ConfigError(f"DeepSpeed config: activation_checkpointing.{key}: acts on activations partitioned "
                              "over tensor-parallel ranks, and this pipeline has none; remove the key")
    if ckpt.get("profile") and pipe.get("use_reentrant") is False:
        raise ConfigError("DeepSpeed config: activation_checkpointing.profile with pipeline.use_reentrant=false: "
                          "DeepSpeed's non-reentrant checkpoint stops a profile timer it never started (an "
                          "AssertionError in the backward); profile with the reentrant checkpoint")
    if "activation_checkpointing" in ds and interval == 0 and "activation_checkpoint_interval" in pipe:
        raise ConfigError("DeepSpeed config: an activation_checkpointing section with "
                          "pipeline.activation_checkpoint_interval=0: checkpointing is off; remove one of them")
    check_monitors(ds, log_wandb)


def _only_known(name: str, section: dict, known: set[str]) -> None:
    for key in section:
        if key not in known:
            raise ConfigError(f"DeepSpeed config: {name}.{key}: not a key of DeepSpeed's {name} section "
                              f"({', '.join(sorted(known))})")


def check_monitors(ds: dict, log_wandb: bool) -> None:
    for key, package in MONITORS.items():
        if not ds.get(key, {}).get("enabled", False):
            continue
        if package and importlib.util.find_spec(package) is None:
            raise ConfigError(f"DeepSpeed config: {key}.enabled needs the '{package}' package (pip install {package})")
    if ds.get("wandb", {}).get("enabled") and not log_wandb:
        raise ConfigError("DeepSpeed config: wandb.enabled with log.wandb=false: the run's wandb logging is "
                          "log.wandb (the wandb section names its project, group and team); choose one")


def checkpoint_interval(ds: dict) -> int:
    """Decoder layers per recomputed segment: pipeline.activation_checkpoint_interval, else 1 when the
    config has an activation_checkpointing section (it asks for checkpointing), else 0 (off)."""
    pipe = ds.get("pipeline", {})
    return pipe.get("activation_checkpoint_interval", 1 if "activation_checkpointing" in ds else 0)


def engine_config(ds: dict) -> dict:
    """The DeepSpeed config the engine gets: the checkpoint interval resolved; no monitor sections
    (the run's logger writes every step's metrics to them instead of the engine writing each pass's
    loss: this trainer's passes are log-prob passes and per-mini-batch updates); and with bf16 and
    ZeRO-1, gradients accumulated in fp32 (`data_types.grad_accum_dtype`), which DeepSpeed 0.19.8
    otherwise leaves at the model's dtype (it then steps its bf16 optimizer, ZeRO-1 partitioned)."""
    out = {k: v for k, v in ds.items() if k not in MONITORS}
    out["pipeline"] = {**ds.get("pipeline", {}), "activation_checkpoint_interval": checkpoint_interval(ds)}
    if bf16_with_zero(ds):
        out["data_types"] = {**ds.get("data_types", {}), "grad_accum_dtype": "fp32"}
    return out
