"""The run's configuration: DeepSpeed's JSON plus our `twocircuit` block.

A recipe is one DeepSpeed JSON file. DeepSpeed's own top-level keys are passed to DeepSpeed; the
`"twocircuit"` block is ours, typed by the dataclasses of schema.py, merged with `key=value`
overrides from the command line (OmegaConf dotlist) and validated strictly (checks.py,
deepspeed_keys.py). Everything here runs before any process group exists, so a wrong config fails
in seconds with one line that names the key (`ConfigError`).
"""
import json
import os
import pathlib
import sys
from dataclasses import dataclass

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from .checks import validate
from .deepspeed_keys import check_deepspeed_keys, deepspeed_known_keys
from .schema import (AnchorConfig, CodecConfig, ConfigError, ControlConfig, DataConfig, GRPOConfig, LogConfig,
                     ModelConfig, TinyModelConfig, TrainConfig, TwoCircuitConfig, describe)

__all__ = ["RunConfig", "load_config", "load_or_exit", "load_recipe", "merge_twocircuit", "to_yaml", "as_dict",
           "ConfigError", "describe", "check_deepspeed_keys", "deepspeed_known_keys", "TwoCircuitConfig",
           "ModelConfig", "TinyModelConfig", "DataConfig", "GRPOConfig", "TrainConfig", "CodecConfig",
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
    validate(tc, raw, world_size)
    return RunConfig(tc=tc, ds=raw, world_size=world_size)


def load_or_exit(loader, *args, report: bool = True) -> RunConfig:
    """`loader(*args)` for an entry point: a ConfigError becomes one `config error:` line on stderr
    (when `report`, e.g. on rank 0 only) and exit status 2, before anything else starts."""
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


def to_yaml(tc: TwoCircuitConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(tc))


def as_dict(tc: TwoCircuitConfig) -> dict:
    """The block as plain containers (for wandb and the anchor's config file)."""
    return OmegaConf.to_container(OmegaConf.structured(tc))
