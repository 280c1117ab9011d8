"""Crash-safe checkpoints: DeepSpeed writes the files, a manifest seals them, then `latest` names them.

DeepSpeed 0.19.8's `save_checkpoint` has rank 0 write `latest` right after rank 0's own files,
before the barrier that waits for the other ranks', and writes it in place (open, truncate, write).
A crash in that window leaves `latest` naming a checkpoint with files missing or half written, or
an empty `latest`. So the trainer saves with `save_latest=False` and then, once every rank's files
are on disk (DeepSpeed's closing barrier):

    every node's local rank 0:  tag/manifest.<node>.json = {file: (bytes, sha256)} of what it sees
    barrier; rank 0:            latest ← tag             (temporary file + atomic rename)

so `latest` only ever names a sealed checkpoint. `--resume` checks the files against the manifests
before DeepSpeed reads any (one manifest per node: on a shared filesystem they list the same files,
on node-local disks each lists its node's), and a missing, truncated or altered file is refused
with its name. The checks import nothing heavy and run before any process group; `Checkpointer`
(the trainer's save and load through DeepSpeed's engine) imports torch only when it runs.
"""
import hashlib
import json
import os
import pathlib

from ..config.schema import ConfigError
from .faults import fault_point
from .files import write_atomic

MANIFEST = "manifest.{node}.json"


class CheckpointError(ConfigError):
    """A checkpoint that cannot be resumed from; reported like a config error, before anything starts."""
    label = "checkpoint error"


def sha256(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def seal(tag_dir: pathlib.Path, node: str) -> pathlib.Path:
    """Write tag_dir/manifest.<node>.json over every file under tag_dir (manifests aside); → its path."""
    files = {str(p.relative_to(tag_dir)): {"bytes": p.stat().st_size, "sha256": sha256(p)}
             for p in sorted(tag_dir.rglob("*")) if p.is_file() and not p.name.startswith("manifest.")}
    out = tag_dir / MANIFEST.format(node=node)
    write_atomic(out, json.dumps({"tag": tag_dir.name, "files": files}, indent=1))
    return out


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
    manifests = sorted(tag_dir.glob(MANIFEST.format(node="*")))
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

    def __init__(self, engine, run_dir: pathlib.Path):
        self.engine, self.dir = engine, run_dir / "checkpoints"

    def save(self, done: int, anchor_fire: int) -> None:
        """DeepSpeed's save, sealed by each node, then named by `latest` (every rank calls it;
        `anchor_fire`: the fire the anchor holds, −1 without one)."""
        import torch.distributed as dist

        from ..pipeline import comm
        tag = f"step{done}"
        fault_point("save", done)
        self.engine.save_checkpoint(str(self.dir), tag=tag, client_state={"step": done, "anchor_fire": anchor_fire},
                                    save_latest=False)
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:          # DeepSpeed's save ends in a barrier
            seal(self.dir / tag, f"node{os.environ.get('CROSS_RANK', '0')}")
        comm.barrier()
        if dist.get_rank() == 0:
            point_latest(self.dir, tag)

    def load(self, anchored: bool) -> tuple[int, int | None]:
        """→ (steps done, the anchor fire held then; None without an anchor or from a checkpoint that
        did not record it)."""
        if not (self.dir / "latest").is_file():
            raise ValueError(f"--resume: no checkpoint under {self.dir}")
        _, client = self.engine.load_checkpoint(str(self.dir))
        fire = client.get("anchor_fire")
        return int(client["step"]), (int(fire) if fire is not None and anchored else None)
