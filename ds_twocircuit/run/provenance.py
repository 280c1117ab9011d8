"""What a run was made from: the code's commit, the starting weights' digest and the machine, one
entry per launch in `run_dir/provenance.json`, so that a table built from run directories can
refuse to compare runs of different starts or code.

    commit          `git rev-parse HEAD` of the package's checkout ("unknown" outside one), and
                    whether its tracked files differed from it (`dirty`)
    start           the base model directory and the sha256 of its weight files (a single file's is
                    what `sha256sum` prints; shards: the sha256 of their digests in name order). A
                    directory that ships a SHA256SUMS is checked against it: a weight file that does
                    not match is refused before any process group starts
    machine         CPU model, its family/model/stepping and the vector ISA torch dispatches to
                    (two CPUs sold under one name can round differently: a seeded run repeats bit
                    for bit only where these match), torch and DeepSpeed versions, the world size
    step            the step the launch started from (0, or the checkpoint's on --resume)
"""
import datetime
import hashlib
import json
import os
import pathlib
import platform
import subprocess

from ..config.schema import ConfigError
from .checkpoint import sha256
from .files import write_atomic

WEIGHT_SUFFIXES = (".safetensors", ".bin")


def listed_sums(model_dir: pathlib.Path) -> dict[str, str]:
    """name → sha256 from the directory's SHA256SUMS (`sha256sum` format), {} without one."""
    sums = model_dir / "SHA256SUMS"
    if not sums.is_file():
        return {}
    out = {}
    for line in sums.read_text().splitlines():
        if line.strip():
            digest, name = line.split(maxsplit=1)
            out[name.lstrip("*")] = digest
    return out


def weights_digest(model_dir: str | os.PathLike) -> tuple[str, bool]:
    """→ (the digest of the directory's weight files, whether SHA256SUMS vouched for every one).
    Raises ConfigError when a listed weight file's sha256 is not the listed one."""
    d = pathlib.Path(model_dir)
    files = sorted(p for p in d.iterdir() if p.name.endswith(WEIGHT_SUFFIXES) and p.name != "training_args.bin")
    if not files:
        raise ConfigError(f"{d}: no weight files (*.safetensors) to take the starting digest of")
    listed = listed_sums(d)
    digests = []
    for p in files:
        got = sha256(p)
        if p.name in listed and listed[p.name] != got:
            raise ConfigError(f"{p}: sha256 {got[:16]}… is not the {listed[p.name][:16]}… its SHA256SUMS lists "
                                  "(a corrupt or changed copy of the starting model)")
        digests.append(got)
    whole = digests[0] if len(digests) == 1 else hashlib.sha256("".join(digests).encode()).hexdigest()
    return whole, bool(listed) and all(p.name in listed for p in files)


def code_commit() -> dict:
    """The package checkout's commit and whether its tracked files differ from it."""
    root = pathlib.Path(__file__).resolve().parents[2]
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                    capture_output=True, text=True, check=True).stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        return {"commit": "unknown", "dirty": None}
    return {"commit": sha, "dirty": dirty}


def start_of(model_dir: str) -> dict:
    """The starting model's entry: its directory and weights' digest, checked (ConfigError if not)."""
    digest, vouched = weights_digest(model_dir)
    return {"dir": str(pathlib.Path(model_dir).resolve()), "weights_sha256": digest, "checked_against_sha256sums": vouched}


def entry(start: dict, step: int, world_size: int) -> dict:
    import deepspeed
    import torch
    return {"launched": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "step": step,
            **code_commit(), "start": start,
            "machine": {"cpu": cpu_model(), "cpu_id": cpu_id(), "cpu_isa": torch.backends.cpu.get_cpu_capability(),
                        "torch": torch.__version__, "deepspeed": deepspeed.__version__, "world_size": world_size}}


def cpu_model() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_id() -> str:
    """"family F model M stepping S" from /proc/cpuinfo's first processor; "" where there is none."""
    try:
        first = pathlib.Path("/proc/cpuinfo").read_text().split("\n\n")[0]
    except OSError:
        return ""
    f = {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in first.splitlines() if ":" in line)}
    return f"family {f.get('cpu family', '?')} model {f.get('model', '?')} stepping {f.get('stepping', '?')}"


def record(run_dir: pathlib.Path, start: dict, step: int, world_size: int) -> dict:
    """Append this launch's entry to run_dir/provenance.json (a fresh run starts the list); → it."""
    path = run_dir / "provenance.json"
    launches = json.loads(path.read_text())["launches"] if step > 0 and path.is_file() else []
    new = entry(start, step, world_size)
    write_atomic(path, json.dumps({"launches": launches + [new]}, indent=1) + "\n")
    return new


def read(run_dir: pathlib.Path) -> list[dict]:
    """A run's launches (oldest first); [] for a run made before provenance was recorded."""
    path = pathlib.Path(run_dir) / "provenance.json"
    return json.loads(path.read_text())["launches"] if path.is_file() else []
