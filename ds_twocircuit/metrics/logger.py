"""The run's logger: one flat namespaced dict per step to `metrics.jsonl` (and wandb, offline unless
the user is logged in or WANDB_MODE says otherwise); held-out evaluations to `eval.jsonl`. Rank 0 only.

The monitor sections of the DeepSpeed config act here, on these rows: `tensorboard`, `csv_monitor`
and `comet` receive every metric through DeepSpeed's own monitors, and `wandb` names the project,
group and team of the run's wandb run. (The engine gets none of them: it would log each pass's
loss, and most passes here are log-prob passes.)
"""
import json
import os
import pathlib
import uuid


class RunLogger:
    """One flat namespaced dict per step → metrics.jsonl (+ wandb). Rank 0 only; others get `None`."""

    def __init__(self, run_dir: pathlib.Path, config: dict, use_wandb: bool, project: str, resume_step: int | None):
        self.run_dir = run_dir
        for name in ("metrics.jsonl", "eval.jsonl"):
            _truncate_after(run_dir / name, resume_step)
        self.wandb = _start_wandb(run_dir, config, project, resume_step is not None) if use_wandb else None
        # a resumed run replays the steps after its checkpoint, bit for bit: a wandb run it continues
        # keeps the ones it has (its steps only grow) and gets the rows from its next step on
        self.wandb_after = self.wandb.starting_step - 1 if self.wandb is not None and self.wandb.resumed else -1
        self.monitor = _deepspeed_monitors(config)

    def log(self, row: dict, file: str = "metrics.jsonl") -> None:
        with open(self.run_dir / file, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.wandb is not None and row["step"] > self.wandb_after:   # numbers only: per-prompt scores stay in the file
            self.wandb.log({(f"eval/{k}" if file == "eval.jsonl" and k != "step" else k): v
                            for k, v in row.items() if isinstance(v, (int, float))}, step=row["step"])
        if self.monitor is not None:
            prefix = "eval/" if file == "eval.jsonl" else ""
            self.monitor.write_events([(prefix + k, float(v), row["step"]) for k, v in row.items()
                                       if k != "step" and isinstance(v, (int, float))])

    def rows(self, file: str = "metrics.jsonl") -> list[dict]:
        path = self.run_dir / file
        return [json.loads(l) for l in path.read_text().splitlines() if l.strip()] if path.exists() else []

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()


def _truncate_after(path: pathlib.Path, resume_step: int | None) -> None:
    """On resume keep only rows of steps before the resumed step (they will be written again)."""
    if resume_step is None or not path.exists():
        if resume_step is None and path.exists():
            path.unlink()
        return
    rows = [l for l in path.read_text().splitlines() if l.strip() and json.loads(l)["step"] < resume_step]
    path.write_text("".join(r + "\n" for r in rows))


def _start_wandb(run_dir: pathlib.Path, config: dict, project: str, resume: bool):
    """wandb's run for this run dir: online when the user is logged in (or WANDB_MODE says so), else
    offline. Online, a resumed run continues the wandb run its start created (the id kept in
    wandb/run_id). Offline each start is its own wandb run: wandb cannot append one offline run to
    another (syncing two of one id keeps one of them)."""
    import wandb
    mode = os.environ.get("WANDB_MODE")
    if mode is None:
        mode = "online" if wandb.login(prompt=False, verify=False) else "offline"
    id_file = run_dir / "wandb" / "run_id"
    again = resume and mode == "online" and id_file.is_file()
    run_id = id_file.read_text().strip() if again else uuid.uuid4().hex[:8]
    id_file.parent.mkdir(parents=True, exist_ok=True)
    id_file.write_text(run_id)
    ds = config.get("wandb", {}) if config.get("wandb", {}).get("enabled") else {}
    return wandb.init(project=ds.get("project", project), group=ds.get("group"), entity=ds.get("team"),
                      dir=str(run_dir), config=config, mode=mode, name=run_dir.name, id=run_id,
                      resume="allow" if again else None,
                      settings=wandb.Settings(quiet=True))   # no summary table at exit (metrics.jsonl has it)


def _deepspeed_monitors(config: dict):
    """DeepSpeed's MonitorMaster over the config's enabled tensorboard/csv_monitor/comet sections, or None."""
    sections = {k: config[k] for k in ("tensorboard", "csv_monitor", "comet") if config.get(k, {}).get("enabled")}
    if not sections:
        return None
    from deepspeed.monitor.config import get_monitor_config
    from deepspeed.monitor.monitor import MonitorMaster
    return MonitorMaster(get_monitor_config(sections))
