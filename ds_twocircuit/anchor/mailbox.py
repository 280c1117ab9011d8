"""Checkpoint shipping between the trainer and the anchor: files only, nothing unpickled.

Layout under the mailbox directory (any file transport can carry it between hosts):

    config.json                             the trainer's config (the anchor's loss, model, β_M)
    fire/step{f:08d}.json                   request: fire f, its weights step s, the forecast's older step
    theta/step{s:08d}/stage{i}.safetensors  + stage{i}.json   θ(s) of stage i, HF names, stage order: whole,
    theta/step{s:08d}/stage{i}.delta                          or as a lossless delta against the previous
                                                              shipped step (sync/delta.py; the manifest names it)
    batch/step{s:08d}.safetensors           + .json           the rollout batch θ(s) generated
    sign/step{f:08d}/stage{i}.sign                            sign(M) bits of stage i, with header
    sign/step{f:08d}/bases.safetensors      + .json           lowrank bases refreshed at fire f
    state/step{f:08d}.safetensors           + .json           the anchor's M (and bases) after fire f: the
                                                              last 2 and every one from the pinned fire on
    pin.json                                                  the fire and step of the trainer's newest checkpoint
    rewind.json                                               written by a resumed trainer: a running anchor reloads
    STOP                                                      the trainer is done: the anchor exits

Crash consistency: a trainer checkpoint after step s records the fire h whose sign it held (pin.json
says the same to the anchor, which keeps its state of fire h and every later one). `rewind(h, s)`
on --resume removes what lies past that checkpoint: the requests for fires whose weights step is s
or later and their shipped θ and batches (the resumed trainer ships them again), and every sign and
state of a fire after h. The anchor then resumes M from fire h and recomputes the later fires, from
the kept inputs of steps before s and the reshipped ones, as the uninterrupted run did.

θ as deltas: each shipped θ(s) is either whole (a keyframe) or the delta of each tensor's values
since the previous shipped step, θ(base); a reader rebuilds it through that chain from the keyframe
(or from a step it already holds), bit for bit. The trainer ships a keyframe first, and again once
the deltas since the last one add up to KEYFRAME_CHAIN keyframes, which bounds what a restarted
anchor reads; `prune` keeps every θ that a kept step's chain reaches back to.

A tensor file's manifest (JSON) holds step, sha256 of the file and every tensor's shape; a reader
checks all three and raises `MailboxError` naming the file. A sign file is a fixed 96-byte header
(magic, version, step, stage, parameter count, sha256 of the stage's (name, shape) layout, sha256
of the payload) followed by ⌈P/8⌉ bytes of bits (see sign.py). Every file is written under a
temporary name and renamed into place, so a reader never sees half a file.
"""
import hashlib
import json
import os
import pathlib
import shutil
import struct

import torch
from safetensors.torch import load_file, save_file

from ..sync.delta import decode_all
from ..run.files import write_atomic

MAGIC = b"TCSIGN\0\0"
VERSION = 1
_HEADER = struct.Struct("<8sIqiq32s32s")   # 96 bytes
HEADER_BYTES = _HEADER.size
KEYFRAME_CHAIN = 4     # a θ keyframe again once the deltas since the last one hold this many keyframes' bytes


class MailboxError(ValueError):
    """A shipped file is missing, corrupt, truncated, stale or does not match what the reader expects."""


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def layout_digest(shapes: dict[str, tuple]) -> bytes:
    """sha256 of the ordered (name, shape) list: both ends must agree on the parameter layout."""
    text = ";".join(f"{n}:{','.join(map(str, s))}" for n, s in shapes.items())
    return hashlib.sha256(text.encode()).digest()


# ---- paths and requests ------------------------------------------------------------------
def theta_path(root: pathlib.Path, step: int, stage: int) -> pathlib.Path:
    return root / "theta" / f"step{step:08d}" / f"stage{stage}.safetensors"


def delta_path(root: pathlib.Path, step: int, stage: int) -> pathlib.Path:
    return theta_path(root, step, stage).with_suffix(".delta")


def batch_path(root: pathlib.Path, step: int) -> pathlib.Path:
    return root / "batch" / f"step{step:08d}.safetensors"


def sign_dir(root: pathlib.Path, fire: int) -> pathlib.Path:
    return root / "sign" / f"step{fire:08d}"


def state_path(root: pathlib.Path, fire: int) -> pathlib.Path:
    return root / "state" / f"step{fire:08d}.safetensors"


def steps_in(d: pathlib.Path, suffix: str = "") -> list[int]:
    if not d.is_dir():
        return []
    return sorted(int(p.name[4:len(p.name) - len(suffix)]) for p in d.iterdir()
                  if p.name.startswith("step") and p.name.endswith(suffix) and p.name[4:len(p.name) - len(suffix)].isdigit())


def published_fires(root: pathlib.Path) -> list[int]:
    """Fires whose sign directory is in place (it is renamed in whole, so present means complete)."""
    return steps_in(root / "sign")


def prune(root: pathlib.Path, inputs_before: int, signs_before: int) -> None:
    """Remove shipped batches of steps before `inputs_before`, θ no kept step's delta chain reaches
    (module docstring), and signs of fires before `signs_before` (what no fire can read any more)."""
    floor = _chain_floor(root, inputs_before)
    for step in steps_in(root / "theta"):
        if step < floor:
            shutil.rmtree(root / "theta" / f"step{step:08d}", ignore_errors=True)
    for step in steps_in(root / "batch", ".safetensors"):
        if step < inputs_before:
            _remove_batch(root, step)
    for f in published_fires(root):
        if f < signs_before:
            shutil.rmtree(sign_dir(root, f), ignore_errors=True)


def theta_base(root: pathlib.Path, step: int) -> int | None:
    """The step θ(step) is a delta against; None for a keyframe (or an unreadable manifest)."""
    try:
        return json.loads(theta_path(root, step, 0).with_suffix(".json").read_text()).get("base")
    except (OSError, json.JSONDecodeError):
        return None


def _chain_floor(root: pathlib.Path, before: int) -> int:
    """The oldest θ step that the chain of the oldest θ at or after `before` reaches back to."""
    kept = [s for s in steps_in(root / "theta") if s >= before]
    if not kept:
        return before
    step = kept[0]
    while (base := theta_base(root, step)) is not None:
        step = base
    return min(step, before)


def _input_steps(root: pathlib.Path) -> list[int]:
    return sorted(set(steps_in(root / "theta")) | set(steps_in(root / "batch", ".safetensors")))


def _remove_inputs(root: pathlib.Path, step: int) -> None:
    """θ(step) of every stage and the batch it generated (shipped together, rewound together)."""
    shutil.rmtree(root / "theta" / f"step{step:08d}", ignore_errors=True)
    _remove_batch(root, step)


def _remove_batch(root: pathlib.Path, step: int) -> None:
    for suffix in (".safetensors", ".json"):
        batch_path(root, step).with_suffix(suffix).unlink(missing_ok=True)


def write_state(root: pathlib.Path, fire: int, tensors: dict[str, torch.Tensor], keep: int = 2) -> None:
    """The anchor's state after fire f, in a file of its own; the `keep` newest and those of the
    pinned fire on are kept (a resume may rewind to them). A process killed between the tensor
    file's and its manifest's rename leaves a file that does not check out, and the previous fire's
    state is still there to fall back to (read_state)."""
    write_tensors(state_path(root, fire), fire, tensors)
    pinned = read_pin(root)["fire"]
    for f in steps_in(root / "state", ".safetensors")[:-keep]:
        if pinned < 0 or f < pinned:   # a resume rewinds to the pinned fire at the earliest
            _remove_state(root, f)


def _remove_state(root: pathlib.Path, fire: int) -> None:
    for suffix in (".safetensors", ".json"):
        state_path(root, fire).with_suffix(suffix).unlink(missing_ok=True)


def write_pin(root: pathlib.Path, fire: int, step: int) -> None:
    """The trainer's newest checkpoint: after `step` steps, holding the sign of `fire`."""
    write_atomic(root / "pin.json", json.dumps({"fire": fire, "step": step}).encode())


def read_pin(root: pathlib.Path) -> dict:
    """→ {"fire", "step"} of the newest checkpoint; fire −1 before any, or when it held no sign
    (then a resume starts M afresh: no state needs keeping)."""
    try:
        return json.loads((root / "pin.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {"fire": -1, "step": 0}


def rewind(root: pathlib.Path, fire: int, step: int, pin: bool = True) -> dict[str, int]:
    """Remove what lies past a checkpoint taken after `step` steps holding the sign of `fire` (see
    the module docstring), pin it (`pin`; a fresh run, rewinding to (−1, 0), unpins), and write
    rewind.json for a running anchor; → counts removed."""
    gone = {"requests": 0, "inputs": 0, "signs": 0, "states": 0}
    for f in steps_in(root / "fire", ".json"):
        path = root / "fire" / f"step{f:08d}.json"
        try:
            shipped_at = json.loads(path.read_text())["weights_step"]
        except (OSError, json.JSONDecodeError, KeyError):
            shipped_at = step   # unreadable: it cannot be trusted, the resumed trainer writes it again
        if shipped_at >= step:
            path.unlink(missing_ok=True)
            gone["requests"] += 1
    for s in _input_steps(root):
        if s >= step:
            _remove_inputs(root, s)
            gone["inputs"] += 1
    for f in published_fires(root):
        if f > fire:
            shutil.rmtree(sign_dir(root, f), ignore_errors=True)
            gone["signs"] += 1
    for f in steps_in(root / "state", ".safetensors"):
        if f > fire:
            _remove_state(root, f)
            gone["states"] += 1
    if pin:
        write_pin(root, fire, step)
    else:
        (root / "pin.json").unlink(missing_ok=True)
    write_atomic(root / "rewind.json", json.dumps({"fire": fire, "step": step, "pid": os.getpid()}).encode())
    return gone


def read_state(root: pathlib.Path) -> tuple[int, dict[str, torch.Tensor], list[str]]:
    """The newest saved state that checks out → (fire, tensors, why each newer one was rejected);
    (-1, {}, ...) when none does."""
    rejected = []
    for f in reversed(steps_in(root / "state", ".safetensors")):
        try:
            return f, read_tensors(state_path(root, f), f), rejected
        except MailboxError as e:
            rejected.append(str(e))
    return -1, {}, rejected


def write_request(root: pathlib.Path, request: dict) -> None:
    write_atomic(root / "fire" / f"step{request['fire']:08d}.json", json.dumps(request).encode())


def pending_requests(root: pathlib.Path, after: int) -> list[dict]:
    """Requests for fires later than `after`, in fire order."""
    out = []
    for f in steps_in(root / "fire", ".json"):
        if f > after:
            try:
                out.append(json.loads((root / "fire" / f"step{f:08d}.json").read_text()))
            except json.JSONDecodeError as e:
                raise MailboxError(f"fire request {f}: corrupt ({e})") from None
    return out


def manifest_shapes(path: pathlib.Path) -> dict[str, tuple]:
    """The tensor names of a shipped file in the order they were written, with their shapes."""
    try:
        return {n: tuple(s) for n, s in json.loads(path.with_suffix(".json").read_text())["shapes"].items()}
    except (OSError, json.JSONDecodeError, KeyError) as e:
        raise MailboxError(f"{path}: unreadable manifest ({e})") from None


# ---- tensors (θ and rollout batches) -------------------------------------------------------
def write_tensors(path: pathlib.Path, step: int, tensors: dict[str, torch.Tensor]) -> None:
    """`path` (.safetensors) and its manifest `path.json`; the manifest lands last."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({n: t.detach().contiguous().cpu() for n, t in tensors.items()}, str(tmp))
    data = tmp.read_bytes()
    os.replace(tmp, path)
    manifest = {"step": step, "file": path.name, "sha256": _sha256(data),
                "shapes": {n: list(t.shape) for n, t in tensors.items()}}
    write_atomic(path.with_suffix(".json"), json.dumps(manifest).encode())


def write_delta(path: pathlib.Path, step: int, base: int, blob: bytes, shapes: dict[str, tuple],
                dtype: torch.dtype) -> None:
    """A θ delta (`.delta`, sync/delta.py's blob of every tensor in `shapes`' order against θ(base)) and
    its manifest, which lands last."""
    write_atomic(path, blob)
    manifest = {"step": step, "file": path.name, "sha256": _sha256(blob), "base": base,
                "dtype": str(dtype).removeprefix("torch."), "shapes": {n: list(s) for n, s in shapes.items()}}
    write_atomic(path.with_suffix(".json"), json.dumps(manifest).encode())


def read_theta(root: pathlib.Path, step: int, stage: int, shapes: dict[str, tuple] | None = None,
               known: dict[int, dict[str, torch.Tensor]] | None = None) -> dict[str, torch.Tensor]:
    """θ(step) of one stage, rebuilt through its delta chain from the nearest keyframe or from a
    step in `known` (step → this stage's tensors, held by the reader)."""
    known, chain = known or {}, []
    while step not in known:
        path = delta_path(root, step, stage)
        manifest = _manifest(path, step) if path.is_file() else None
        if manifest is None or manifest.get("base") is None:
            break
        chain.append((step, manifest))
        step = manifest["base"]
    cur = known[step] if step in known else read_tensors(theta_path(root, step, stage), step, shapes)
    for s, manifest in reversed(chain):
        path = delta_path(root, s, stage)
        names = list(manifest["shapes"])
        if set(names) != set(cur):
            raise MailboxError(f"{path}: its tensors differ from θ({manifest['base']})'s")
        try:
            news = decode_all([cur[n] for n in names], _checked_bytes(path, manifest),
                              [tuple(manifest["shapes"][n]) for n in names], getattr(torch, manifest["dtype"]))
        except (ValueError, AttributeError) as e:
            raise MailboxError(f"{path}: malformed delta ({e})") from None
        cur = dict(zip(names, news))
    if shapes is not None and {n: tuple(t.shape) for n, t in cur.items()} != {n: tuple(s) for n, s in shapes.items()}:
        raise MailboxError(f"{theta_path(root, step, stage)}: tensor names/shapes differ from this stage's parameters")
    return cur


def _manifest(path: pathlib.Path, step: int) -> dict:
    man_path = path.with_suffix(".json")
    if not man_path.is_file() or not path.is_file():
        raise MailboxError(f"{path}: missing (or its manifest is)")
    try:
        manifest = json.loads(man_path.read_text())
    except json.JSONDecodeError as e:
        raise MailboxError(f"{man_path}: corrupt manifest ({e})") from None
    if manifest.get("step") != step:
        raise MailboxError(f"{path}: manifest says step {manifest.get('step')}, expected {step}")
    return manifest


def _checked_bytes(path: pathlib.Path, manifest: dict) -> bytes:
    data = path.read_bytes()
    if _sha256(data) != manifest.get("sha256"):
        raise MailboxError(f"{path}: sha256 mismatch (corrupt or truncated file)")
    return data


def read_tensors(path: pathlib.Path, step: int, shapes: dict[str, tuple] | None = None) -> dict[str, torch.Tensor]:
    manifest = _manifest(path, step)
    _checked_bytes(path, manifest)
    tensors = load_file(str(path))
    got = {n: list(t.shape) for n, t in tensors.items()}
    if got != manifest["shapes"]:
        raise MailboxError(f"{path}: tensors do not match the manifest's shapes")
    if shapes is not None and got != {n: list(s) for n, s in shapes.items()}:
        raise MailboxError(f"{path}: tensor names/shapes differ from this stage's parameters")
    return tensors


# ---- sign(M) -----------------------------------------------------------------------------
def write_sign(path: pathlib.Path, step: int, stage: int, shapes: dict[str, tuple], bits: bytes, numel: int) -> None:
    header = _HEADER.pack(MAGIC, VERSION, step, stage, numel, layout_digest(shapes), hashlib.sha256(bits).digest())
    write_atomic(path, header + bits)


def read_sign(path: pathlib.Path, stage: int, shapes: dict[str, tuple], newer_than: int = -1) -> tuple[int, bytes, int]:
    """→ (step, bits, numel). Rejects bad magic/version, truncation, checksum, a stale step
    (≤ newer_than) and a layout (names, shapes) other than this stage's."""
    data = path.read_bytes() if path.is_file() else b""
    if len(data) < HEADER_BYTES:
        raise MailboxError(f"{path}: truncated sign file ({len(data)} bytes, header needs {HEADER_BYTES})")
    magic, version, step, st, numel, layout, digest = _HEADER.unpack_from(data)
    if magic != MAGIC or version != VERSION:
        raise MailboxError(f"{path}: not a sign file of version {VERSION}")
    bits = data[HEADER_BYTES:]
    if len(bits) != (numel + 7) // 8:
        raise MailboxError(f"{path}: truncated payload ({len(bits)} of {(numel + 7) // 8} bytes)")
    if hashlib.sha256(bits).digest() != digest:
        raise MailboxError(f"{path}: payload checksum mismatch")
    if st != stage or layout != layout_digest(shapes):
        raise MailboxError(f"{path}: written for stage {st} with another parameter layout; this is stage {stage}")
    if step <= newer_than:
        raise MailboxError(f"{path}: stale sign of step {step} (already hold step {newer_than})")
    return step, bits, numel
