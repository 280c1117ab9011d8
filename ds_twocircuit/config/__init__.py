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
import time
from dataclasses import dataclass

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from .checks import check_set_keys, validate
from .deepspeed_keys import check_deepspeed_keys, check_sections, deepspeed_known_keys
from .schema import (AnchorConfig, CodecConfig, ConfigError, ControlConfig, DataConfig, GRPOConfig, LogConfig,
                     ModelConfig, TinyModelConfig, TrainConfig, WideModelConfig, TwoCircuitConfig, describe)

__all__ = ["RunConfig", "load_config", "load_or_exit", "check_resume", "write_run_config", "load_recipe",
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
                resolved: bool = False) -> RunConfig:
    """Read the JSON, apply dotlist overrides, validate everything. Raises ConfigError. `resolved`:
    the file is a run's whole resolved config (the anchor's copy), whose every key is written out,
    so keys nothing reads are not refused again (the run that wrote it was checked as the user set it)."""
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
    check_sections(raw, len(tc.model.layers_per_stage), tc.log.wandb)
    world_size = world_size or int(os.environ.get("WORLD_SIZE", "1"))
    validate(tc, raw, world_size)
    # a key is refused where it is set: the recipe's in the recipe's own configuration (an override
    # may switch a mode and leave some of them unread), an override's in the run's
    if not resolved:
        check_set_keys(merge_twocircuit(block, []) if overrides else tc, set(_flat(block)))
    check_set_keys(tc, {o.split("=", 1)[0].lstrip("+") for o in overrides})
    return RunConfig(tc=tc, ds=raw, world_size=world_size)


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
             "anchor.max_restarts", "sampler.kv_cache_gib", "sampler.gpu_memory_utilization", "sampler.enforce_eager")


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
    try:   # as write_run_config wrote it
        text, _, ds = saved.read_text().partition("\ndeepspeed: ")
        before = _flat({**OmegaConf.to_container(OmegaConf.create(text)), "deepspeed": json.loads(ds)})
    except (OSError, OmegaConfBaseException, ValueError, yaml.YAMLError) as e:
        raise ConfigError(f"--resume: {saved} is unreadable ({str(e).splitlines()[0]})") from None
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
        raise ConfigError(f"--ds-config {ds_config_path}: {e}") from None
    n_stages = len(merge_twocircuit(block, list(overrides)).model.layers_per_stage)
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
