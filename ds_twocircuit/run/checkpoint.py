"""Crash-safe checkpoints: DeepSpeed writes the files, each rank seals its own, then `latest` names them.

DeepSpeed 0.19.8's `save_checkpoint` has rank 0 write `latest` right after rank 0's own files,
before the barrier that waits for the other ranks', and writes it in place (open, truncate, write).
A crash in that window leaves `latest` naming a checkpoint with files missing or half written, or
an empty `latest`. So the trainer saves with `save_latest=False`, and:

    while DeepSpeed saves:  every path this rank's checkpoint engine writes is recorded
    then every rank:        fsync each of its files, hash it (from the page cache, just written),
                            tag/manifest.rank<R>.json = {file: (bytes, sha256)}, fsync the directory
    barrier; rank 0:        latest ← tag  (temporary file, fsync, atomic rename, fsync the directory)
    then each node:         older sealed checkpoints beyond `keep` removed (`prune`)

so `latest` only ever names a sealed checkpoint whose files are on disk, also after a node loses
power, and a save re-reads each file once, on the rank that wrote it, in parallel. `--resume` checks
the files against every manifest it finds before DeepSpeed reads any (on a shared filesystem all
ranks' manifests, on node-local disks the node's own), and a missing, truncated or altered file is
refused with its name. The checks import nothing heavy and run before any process group;
`Checkpointer` (the trainer's save and load through DeepSpeed's engine) imports torch only when it runs.
"""
import contextlib
import hashlib
import json
import os
import pathlib
import re
import shutil

from ..config.schema import ConfigError
from .faults import fault_point
from .files import fsync_dir, write_atomic

MANIFEST = "manifest.{who}.json"    # who: rank<R>; node<N> in checkpoints sealed per node before


class CheckpointError(ConfigError):
    """A checkpoint that cannot be resumed from; reported like a config error, before anything starts."""
    label = "checkpoint error"


def sha256(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def seal(tag_dir: pathlib.Path, who: str, files: list[pathlib.Path]) -> pathlib.Path:
    """fsync `files` (under tag_dir), then write tag_dir/manifest.<who>.json over them and fsync the
    directory; → the manifest's path."""
    listed = {}
    for p in sorted(set(files)):
        with open(p, "rb") as f:
            os.fsync(f.fileno())
        listed[os.path.relpath(p, tag_dir)] = {"bytes": p.stat().st_size, "sha256": sha256(p)}
    out = tag_dir / MANIFEST.format(who=who)
    write_atomic(out, json.dumps({"tag": tag_dir.name, "files": listed}, indent=1))
    for d in {p.parent for p in files} | {tag_dir}:
        fsync_dir(d)
    return out


@contextlib.contextmanager
def recording_writes(checkpoint_engine):
    """While DeepSpeed saves: → the list of paths this rank's checkpoint engine is asked to write
    (every model, layer, optimizer and ZeRO file of a save goes through its `save`)."""
    written: list[pathlib.Path] = []
    save = checkpoint_engine.save

    def recording_save(state_dict, path):
        written.append(pathlib.Path(path))
        return save(state_dict, path)

    checkpoint_engine.save = recording_save
    try:
        yield written
    finally:
        del checkpoint_engine.save      # the engine's own method again


STEP_TAG = re.compile(r"step(\d+)")


def prune(ckpt_dir: pathlib.Path, keep: int, protect: set[str]) -> list[str]:
    """Remove sealed checkpoints older than the newest `keep` sealed ones (keep = 0: none removed),
    never a tag in `protect` (the one `latest` names, the one the anchor pins) nor a newer one. A
    checkpoint without a manifest is left alone: it may be one being written, or one written before
    sealing. → the tags removed."""
    if keep <= 0:
        return []
    sealed = sorted((int(m.group(1)), d.name) for d in ckpt_dir.iterdir()
                    if d.is_dir() and (m := STEP_TAG.fullmatch(d.name)) and any(d.glob(MANIFEST.format(who="*"))))
    newest_protected = max((int(m.group(1)) for t in protect if (m := STEP_TAG.fullmatch(t))), default=-1)
    gone = [tag for step, tag in sealed[:-keep] if tag not in protect and step < newest_protected]
    for tag in gone:
        shutil.rmtree(ckpt_dir / tag, ignore_errors=True)    # another node sharing the disk may race us
    return gone


def point_latest(ckpt_dir: pathlib.Path, tag: str) -> None:
    write_atomic(ckpt_dir / "latest", tag)


def verify_latest(ckpt_dir: pathlib.Path) -> str:
    """The tag `latest` names, after checking its files against its manifests; raises CheckpointError
    naming the first missing, truncated or altered file. A checkpoint written before manifests
    existed has none: it is accepted unchecked, and the returned note says so."""
    latest = ckpt_dir / "latest"
    tag = latest.read_text().strip() if latest.is_file() else ""
    if not tag:
        raise CheckpointError(f"{latest}: missing or empty, so no checkpoint to resume from")
    tag_dir = ckpt_dir / tag
    if not tag_dir.is_dir():
        raise CheckpointError(f"{latest} names {tag}, but {tag_dir} does not exist")
    manifests = sorted(tag_dir.glob(MANIFEST.format(who="*")))
    if not manifests:
        return f"{tag} (no manifest: written before checkpoints were sealed, not verified)"
    for m in manifests:
        try:
            files = json.loads(m.read_text())["files"]
        except (OSError, ValueError, KeyError) as e:
            raise CheckpointError(f"{m}: unreadable manifest ({e})") from None
        for name, want in files.items():
            check_file(tag_dir / name, want)
    return f"{tag} ({sum(1 for _ in manifests)} manifest(s) verified)"


def check_file(path: pathlib.Path, want: dict) -> None:
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} is missing")
    size = path.stat().st_size
    if size != want["bytes"]:
        raise CheckpointError(f"checkpoint file {path} is truncated or altered: {size} bytes, "
                              f"sealed at {want['bytes']}")
    if sha256(path) != want["sha256"]:
        raise CheckpointError(f"checkpoint file {path} is corrupt: its sha256 differs from the one it was sealed with")


class Checkpointer:
    """The trainer's checkpoints under `run_dir/checkpoints/step<N>`: DeepSpeed's own files, with the
    step and the anchor fire held then as client state."""

    def __init__(self, engine, run_dir: pathlib.Path, keep: int):
        self.engine, self.dir, self.keep = engine, run_dir / "checkpoints", keep

    def save(self, done: int, anchor_fire: int, ahead: dict | None = None) -> None:
        """DeepSpeed's save, each rank sealing the files it wrote, then named by `latest` (every rank
        calls it; `anchor_fire`: the fire the anchor holds, −1 without one; `ahead`: rank 0's batches
        generated ahead and not yet trained on, kept in its own client state)."""
        import torch.distributed as dist

        from ..pipeline import comm
        tag = f"step{done}"
        fault_point("save", done)
        with recording_writes(self.engine.checkpoint_engine) as written:
            client = {"step": done, "anchor_fire": anchor_fire, **({"rollouts_ahead": ahead} if ahead else {})}
            self.engine.save_checkpoint(str(self.dir), tag=tag, client_state=client, save_latest=False)
        if written:
            seal(self.dir / tag, f"rank{dist.get_rank()}", written)
        comm.barrier()
        if dist.get_rank() == 0:
            point_latest(self.dir, tag)

    def prune(self) -> list[str]:
        """Each node's local rank 0, after `latest` and the anchor's pin moved to the new checkpoint:
        older sealed checkpoints beyond `keep` removed. The anchor pins the newest checkpoint's fire
        (anchor/mailbox.py), the one `latest` names, so protecting `latest` protects the pin; a node
        that reads `latest` before rank 0 moved it protects the previous one and removes nothing newer."""
        if int(os.environ.get("LOCAL_RANK", "0")) != 0:
            return []
        latest = (self.dir / "latest").read_text().strip() if (self.dir / "latest").is_file() else ""
        return prune(self.dir, self.keep, {latest})

    def load(self, anchored: bool) -> tuple[int, int | None, dict]:
        """→ (steps done, the anchor fire held then (None without an anchor or from a checkpoint that
        did not record it), the batches generated ahead that this rank saved ({} but on rank 0 with
        rollout.staleness > 0))."""
        if not (self.dir / "latest").is_file():
            raise ValueError(f"--resume: no checkpoint under {self.dir}")
        _, client = self.engine.load_checkpoint(str(self.dir))
        fire = client.get("anchor_fire")
        return int(client["step"]), (int(fire) if fire is not None and anchored else None), client.get("rollouts_ahead", {})
