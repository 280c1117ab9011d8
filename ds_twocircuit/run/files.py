"""Files that appear whole or not at all: written under a temporary name, synced, renamed into place
(and the directory synced, so the new name survives a power loss).

A reader (the anchor, a resumed trainer, another node) never sees half a file; a process killed
mid-write leaves only a hidden `.NAME.tmpPID` behind.
"""
import os
import pathlib


def write_atomic(path: pathlib.Path, data: bytes | str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)     # the rename itself on disk


def fsync_dir(path: pathlib.Path) -> None:
    """fsync a directory, so that the names created or renamed in it survive a power loss."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
