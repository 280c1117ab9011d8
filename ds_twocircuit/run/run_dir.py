"""What a run directory holds, and the rule that a new run never writes over an old one by accident.

A run writes config.yaml, metrics.jsonl, eval.jsonl, provenance.json, checkpoints/, model/, the
anchor's mailbox and wandb's files into its `--run-dir`. Starting a run there again would truncate
the rows, replace the export and rewind the mailbox beside the old checkpoints, so a directory that
holds any of them needs `--resume` (continue it) or `--overwrite` (delete that run first, as HF
Trainer's `overwrite_output_dir` asks to be said). Light: no torch.
"""
import json
import pathlib
import shutil

from ..config.schema import ConfigError

RUN_FILES = ("config.yaml", "metrics.jsonl", "eval.jsonl", "provenance.json", "checkpoints", "model", "anchor", "wandb")


def held_run(run_dir: pathlib.Path) -> list[str]:
    """The names in run_dir that a run writes (none: a fresh or unrelated directory)."""
    return [n for n in RUN_FILES if (run_dir / n).exists()]


def last_step(run_dir: pathlib.Path) -> int | None:
    """The step of metrics.jsonl's last complete row, or None."""
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return None


def sealed_checkpoint(run_dir: pathlib.Path) -> str | None:
    """The checkpoint `checkpoints/latest` names (e.g. 'global_step40'), or None."""
    try:
        return (run_dir / "checkpoints" / "latest").read_text().strip() or None
    except OSError:
        return None


def describe(run_dir: pathlib.Path) -> str:
    step, ckpt = last_step(run_dir), sealed_checkpoint(run_dir)
    parts = ([f"metrics up to step {step}"] if step is not None else []) + ([f"checkpoint {ckpt}"] if ckpt else [])
    return ", ".join(parts) or ", ".join(held_run(run_dir))


def check_run_dir(run_dir: pathlib.Path, resume: bool, overwrite: bool) -> None:
    """Raise ConfigError when a new run would write over the run in run_dir."""
    if resume and overwrite:
        raise ConfigError("--resume and --overwrite: continue the run, or clear it and start over, not both")
    if resume or overwrite or not held_run(run_dir):
        return
    raise ConfigError(f"--run-dir {run_dir} already holds a run ({describe(run_dir)}): continue it with --resume, "
                      "start over with --overwrite (deletes that run), or choose another --run-dir")


def clear(run_dir: pathlib.Path) -> None:
    """Delete the run in run_dir (`--overwrite`): every entry a run writes, the anchor's mailbox
    included; anything else there (a launch log, the user's files) stays. (An `anchor.mailbox`
    elsewhere is rewound by the fresh run's anchor link itself.)"""
    for name in RUN_FILES:
        path = run_dir / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)   # two nodes may clear one shared directory
        else:
            path.unlink(missing_ok=True)
    if held_run(run_dir):
        raise ConfigError(f"--overwrite: could not delete the run in {run_dir} ({', '.join(held_run(run_dir))} left)")
