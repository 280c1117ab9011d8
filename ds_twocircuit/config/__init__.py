"""The run's configuration: DeepSpeed's JSON plus our `twocircuit` block.

A recipe is one DeepSpeed JSON file. DeepSpeed's own top-level keys are passed to DeepSpeed; the
`"twocircuit"` block is ours, typed by the dataclasses of schema.py, merged with `key=value`
overrides from the command line (OmegaConf dotlist) and validated strictly (checks.py,
deepspeed_keys.py). Everything here runs before any process group exists, so a wrong config fails
in seconds with one line that names the key (`ConfigError`).
"""
import dataclasses
import json
import os
import pathlib
import sys
import time
from dataclasses import dataclass

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from .checks import check_set_keys, resolve_split, validate
from .deepspeed_keys import check_deepspeed_keys, check_sections, deepspeed_known_keys
from .schema import (AnchorConfig, CodecConfig, ConfigError, ControlConfig, DataConfig, GRPOConfig, LogConfig,
                     ModelConfig, TinyModelConfig, TrainConfig, WideModelConfig, TwoCircuitConfig, describe)

__all__ = ["RunConfig", "load_config", "load_run", "read_run_config", "config_from_dict", "load_or_exit", "check_resume", "write_run_config", "load_recipe",
           "merge_twocircuit", "to_yaml", "as_dict",
           "ConfigError", "describe", "check_deepspeed_keys", "deepspeed_known_keys", "TwoCircuitConfig",
           "ModelConfig", "TinyModelConfig", "WideModelConfig", "DataConfig", "GRPOConfig", "TrainConfig", "CodecConfig",
           "AnchorConfig", "ControlConfig", "LogConfig"]


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


def load_config(ds_config_path: str, overrides: list[str] = (), world_size: int | None = None,
                resolved: bool = False, read_data: bool = True) -> RunConfig:
    """Read the JSON, apply dotlist overrides, validate everything. Raises ConfigError. `resolved`:
    the file is a run's whole resolved config (the anchor's copy), whose every key is written out,
    so keys nothing reads are not refused again (the run that wrote it was checked as the user set it)."""
    path = pathlib.Path(ds_config_path)
    if not path.is_file():
        raise ConfigError(f"--ds-config {ds_config_path}: no such file")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{ds_config_path}: not valid JSON ({e}){_yaml_hint(ds_config_path)}") from None
    return config_from_dict(raw, overrides, world_size, resolved, read_data)


def _yaml_hint(path: str) -> str:
    return " (a run's config.yaml: read it with --run RUN_DIR)" if str(path).endswith((".yaml", ".yml")) else ""


def config_from_dict(raw: dict, overrides: list[str] = (), world_size: int | None = None,
                     resolved: bool = False, read_data: bool = True) -> RunConfig:
    """load_config on a recipe already read: DeepSpeed's keys and the `twocircuit` block.
    `read_data`: this process reads the data set, so its files are checked (only global rank 0 of a
    launch does)."""
    raw = dict(raw)
    block = raw.pop("twocircuit", {})
    ours, theirs = split_overrides(overrides)
    raw = merge_deepspeed(raw, theirs)
    tc = merge_twocircuit(block, ours)
    world_size = world_size or int(os.environ.get("WORLD_SIZE", "1"))
    tc = resolve_split(tc, "model.layers_per_stage" in set(_flat(block)) | set(_keys(ours)), world_size)
    check_deepspeed_keys(raw)
    check_sections(raw, len(tc.model.layers_per_stage), tc.log.wandb)
    validate(tc, raw, world_size, read_data)
    # a key is refused where it is set: the recipe's in the recipe's own configuration (an override
    # may switch a mode and leave some of them unread), an override's in the run's
    if not resolved:
        check_set_keys(merge_twocircuit(block, []) if ours else tc, set(_flat(block)))
    check_set_keys(tc, set(_keys(ours)))
    return RunConfig(tc=tc, ds=raw, world_size=world_size)


DS_PREFIX = "ds."    # `ds.optimizer.params.lr=1e-5`: a DeepSpeed key on the command line


def split_overrides(overrides) -> tuple[list[str], list[str]]:
    """→ (our block's dotted overrides, DeepSpeed's without their `ds.` prefix). A DeepSpeed key
    written without the prefix is refused with the spelling that works."""
    ours, theirs = [], []
    sections = {f.name for f in dataclasses.fields(TwoCircuitConfig)}
    for o in overrides:
        if o.startswith(DS_PREFIX):
            theirs.append(o[len(DS_PREFIX):])
            continue
        head = o.split("=", 1)[0].lstrip("+").split(".")[0]
        if head not in sections and head in deepspeed_known_keys():
            raise ConfigError(f"{o.split('=', 1)[0]} is DeepSpeed's key, not one of the twocircuit block: write "
                              f"{DS_PREFIX}{o}")
        ours.append(o)
    return ours, theirs


def merge_deepspeed(raw: dict, overrides: list[str]) -> dict:
    """DeepSpeed's dict with `key.sub=value` overrides applied (values typed as YAML reads them);
    the result is checked as the file's own keys are."""
    if not overrides:
        return raw
    try:
        merged = OmegaConf.merge(OmegaConf.create(raw), OmegaConf.from_dotlist(overrides))
    except (OmegaConfBaseException, ValueError) as e:
        raise ConfigError(f"DeepSpeed override: {str(e).splitlines()[0]} ({', '.join(DS_PREFIX + o for o in overrides)})") from None
    return OmegaConf.to_container(merged)


def _keys(overrides) -> list[str]:
    return [o.split("=", 1)[0].lstrip("+") for o in overrides]


REPORT_WAIT_S = 30.0     # how long a rank that does not report waits to be stopped


def load_or_exit(loader, *args, report: bool = True) -> RunConfig:
    """`loader(*args)` for an entry point: a ConfigError becomes one `config error:` line (its label)
    on stderr (when `report`, e.g. on rank 0 only) and exit status 2, before anything else starts. A rank that
    does not report waits for the launcher to stop it: the first rank to exit non-zero makes
    DeepSpeed's launcher kill the others, and that must not be one before the reporting rank printed."""
    try:
        return loader(*args)
    except ConfigError as e:
        if report:
            print(f"{e.label}: {e}", file=sys.stderr)
        else:
            time.sleep(REPORT_WAIT_S)
        sys.exit(2)


# keys a resumed run may change: how long it runs, how it reports and waits, not what it computes
RESUMABLE = ("train.steps", "train.eval_every", "train.save_every", "train.keep_checkpoints", "train.max_skipped_steps", "train.collective_timeout",
             "log.", "anchor.timeout",
             "anchor.max_restarts", "anchor.on_failure", "sampler.kv_cache_gib", "sampler.gpu_memory_utilization", "sampler.enforce_eager")


def write_run_config(run: RunConfig, run_dir: pathlib.Path) -> None:
    """run_dir/config.yaml: our block as YAML, then one line `deepspeed: <JSON>` (check_resume reads it)."""
    (run_dir / "config.yaml").write_text(to_yaml(run.tc) + "deepspeed: " + json.dumps(run.ds) + "\n")


def check_resume(run: RunConfig, run_dir: pathlib.Path) -> None:
    """`--resume` into run_dir continues the trajectory its config.yaml describes: a checkpoint must
    be there, and every key but RESUMABLE's must equal the one it was written with. Raises ConfigError
    naming each key that differs (before any process group starts)."""
    saved = run_dir / "config.yaml"
    if not (run_dir / "checkpoints" / "latest").is_file():
        raise ConfigError(f"--resume: no checkpoint under {run_dir / 'checkpoints'} (no 'latest' file)")
    if not saved.is_file():
        raise ConfigError(f"--resume: {saved} is missing: cannot tell which config wrote this run")
    try:
        raw = _parse_run_config(saved)
    except RUN_CONFIG_ERRORS as e:
        raise ConfigError(f"--resume: {saved} is unreadable ({str(e).splitlines()[0]})") from None
    before = _flat({**raw.pop("twocircuit"), "deepspeed": raw})
    now = _flat({**as_dict(run.tc), "deepspeed": run.ds})
    # a key newer than the run it resumes was unset then: its default is what that run did
    before = {**_flat(as_dict(TwoCircuitConfig())), **before}
    differ = sorted(k for k in before.keys() | now.keys()
                    if before.get(k, "<unset>") != now.get(k, "<unset>") and not k.startswith(RESUMABLE))
    if differ:
        pairs = "; ".join(f"{k} was {before.get(k, '<unset>')!r}, now {now.get(k, '<unset>')!r}" for k in differ[:5])
        more = f" (and {len(differ) - 5} more)" if len(differ) > 5 else ""
        raise ConfigError(f"--resume into {run_dir}: written by another config: {pairs}{more}. Resume with the "
                          "same config and overrides, or start a new --run-dir")


def read_run_config(run_dir: pathlib.Path) -> dict:
    """The recipe a run was resolved to, as write_run_config wrote it: DeepSpeed's keys and the
    whole `twocircuit` block. Raises ConfigError."""
    saved = run_dir / "config.yaml"
    try:
        return _parse_run_config(saved)
    except RUN_CONFIG_ERRORS as e:
        raise ConfigError(f"{saved}: not a run's config ({str(e).splitlines()[0]})") from None


RUN_CONFIG_ERRORS = (OSError, OmegaConfBaseException, ValueError, yaml.YAMLError)


def _parse_run_config(saved: pathlib.Path) -> dict:
    text, _, ds = saved.read_text().partition("\ndeepspeed: ")
    return {**json.loads(ds), "twocircuit": OmegaConf.to_container(OmegaConf.create(text))}


def load_run(run_dir: pathlib.Path, overrides: list[str] = ()) -> RunConfig:
    """A finished or running run's config for one process beside it (evaluation): its resolved
    recipe, validated at the run's own world size (its batch keys were derived for it), with
    `overrides` applied."""
    raw = read_run_config(run_dir)
    dp = raw["train_batch_size"] // (raw["train_micro_batch_size_per_gpu"] * raw["gradient_accumulation_steps"])
    n_stages = len(raw["twocircuit"]["model"]["layers_per_stage"])
    return config_from_dict(raw, overrides, world_size=n_stages * dp, resolved=True)


def _flat(tree, prefix: str = "") -> dict:
    """Nested dicts → {dotted key: leaf}; lists are leaves."""
    if not isinstance(tree, dict):
        return {prefix[:-1]: tree}
    out = {}
    for k, v in tree.items():
        out.update(_flat(v, f"{prefix}{k}."))
    return out


def load_recipe(ds_config_path: str, overrides: list[str] = (), resolved: bool = False) -> RunConfig:
    """`load_config` for a single process outside the trainer's world (the anchor, evaluation):
    validated as for one data-parallel replica of the recipe's pipeline."""
    try:
        block = json.loads(pathlib.Path(ds_config_path).read_text()).get("twocircuit", {})
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"--ds-config {ds_config_path}: {e}{_yaml_hint(ds_config_path)}") from None
    ours, _ = split_overrides(overrides)
    given = "model.layers_per_stage" in set(_flat(block)) | set(_keys(ours))
    n_stages = len(resolve_split(merge_twocircuit(block, ours), given, None).model.layers_per_stage)
    return load_config(ds_config_path, overrides, world_size=n_stages, resolved=resolved)


def merge_twocircuit(block: dict, overrides: list[str]) -> TwoCircuitConfig:
    schema = OmegaConf.structured(TwoCircuitConfig)
    try:
        merged = OmegaConf.merge(schema, OmegaConf.create(block), OmegaConf.from_dotlist(overrides))
        return OmegaConf.to_object(merged)
    except (OmegaConfBaseException, TypeError, ValueError) as e:   # a list where a section goes: TypeError
        key = getattr(e, "full_key", None) or _culprit(block, overrides)
        raise ConfigError(f"twocircuit config: {_omegaconf_reason(e)}" + (f" (key '{key}')" if key else "")) from None


def _culprit(block: dict, overrides: list[str]) -> str:
    """The first of the JSON block and the overrides that does not merge onto the schema alone."""
    for part, source in [(block, "the JSON's twocircuit block")] + [([o], o.split("=")[0]) for o in overrides]:
        try:
            extra = OmegaConf.create(part) if isinstance(part, dict) else OmegaConf.from_dotlist(part)
            OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TwoCircuitConfig), extra))
        except Exception:   # noqa: BLE001 (any failure names this part)
            return source
    return ""


def _omegaconf_reason(e: Exception) -> str:
    msg = str(e).splitlines()[0]
    if "not in struct" in msg or "Key '" in msg and "not" in msg:
        return f"unknown key: {msg}"
    return msg


def to_yaml(tc: TwoCircuitConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(tc))


def as_dict(tc: TwoCircuitConfig) -> dict:
    """The block as plain containers (for wandb and the anchor's config file)."""
    return OmegaConf.to_container(OmegaConf.structured(tc))
