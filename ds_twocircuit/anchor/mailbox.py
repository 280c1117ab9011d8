"""Checkpoint shipping between the trainer and the anchor: files only, nothing unpickled.

Layout under the mailbox directory (any file transport can carry it between hosts):

    config.json                             the trainer's config (the anchor's loss, model, β_M)
    fire/step{f:08d}.json                    request: fire f, its weights step s, the forecast's older step
    theta/step{s:08d}/stage{i}.safetensors        θ(s) of stage i, HF names, stage order: whole,
    theta/step{s:08d}/stage{i}.delta.safetensors  or as a lossless delta against the previous shipped
                                                  step (sync/delta.py; its metadata names that step)
    batch/step{s:08d}.safetensors                 the rollout batch θ(s) generated
    sign/step{f:08d}/stage{i}.safetensors         sign(M) bits of stage i
    sign/step{f:08d}/bases.safetensors            lowrank bases refreshed at fire f
    state/step{f:08d}.safetensors                 the anchor's M (and bases) after fire f: the last 2,
                                                  the pinned fire's and those from the trainer's held on
    pin.json                                      the fire and step of the trainer's newest checkpoint
    rewind.json                                   written by a resumed trainer: a running anchor reloads
    STOP                                          the trainer is done: the anchor exits

Crash consistency: a trainer checkpoint after step s records the fire h whose sign it held (pin.json
says the same to the anchor, which keeps its state of fire h and every later one). `rewind(h, s)`
on --resume removes what lies past that checkpoint: the requests for fires whose weights step is s
or later and their shipped θ and batches (the resumed trainer ships them again), and every sign and
state of a fire after h. The anchor then resumes M from fire h and recomputes the later fires, from
the kept inputs of steps before s and the reshipped ones, as the uninterrupted run did. Between
the pin and what pending fires read, nothing is kept (`prune`): a rewind removes it anyway, so the
mailbox holds a few fires' θ and states, not one per step since the last checkpoint.

θ as deltas: each shipped θ(s) is either whole (a keyframe) or the delta of each tensor's values
since the previous shipped step, θ(base); a reader rebuilds it through that chain from the keyframe
(or from a step it already holds), bit for bit. The trainer ships a keyframe first, and again once
the deltas since the last one add up to KEYFRAME_CHAIN keyframes, which bounds what a restarted
anchor reads; `prune` keeps every θ that a kept step's chain reaches back to.

One file format: safetensors, whose metadata (strings) says what the file is. Every file holds

    format, version      "ds_twocircuit.mailbox", "2"
    step                 the step (or fire) it was written for
    tensors              JSON {name: shape} in the order written (safetensors keeps no order)
    sha256               of the names and bytes of its tensors in that order

and a sign file also `stage`, `numel` (P) and `layout` (sha256 of the stage's (name, shape) list),
its one tensor `bits` the ⌈P/8⌉ packed bytes (see sign.py); a θ delta also `base`, `dtype` and
`shapes` (θ's names and shapes, in the stage's order), its one tensor `blob` (sync/delta.py). A
reader checks all of it and raises `MailboxError` naming the file. Every file is written under a
temporary name and renamed into place, so a reader never sees half a file.
"""
import hashlib
import json
import os
import pathlib
import shutil
import struct

import torch
from safetensors.torch import load, save

from ..sync.delta import decode_all
from ..run.files import write_atomic

FORMAT, VERSION = "ds_twocircuit.mailbox", "3"   # 3: a sign file may hold the runs of M = 0
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
    return theta_path(root, step, stage).with_name(f"stage{stage}.delta.safetensors")


def batch_path(root: pathlib.Path, step: int) -> pathlib.Path:
    return root / "batch" / f"step{step:08d}.safetensors"


def sign_dir(root: pathlib.Path, fire: int) -> pathlib.Path:
    return root / "sign" / f"step{fire:08d}"


def sign_path(root: pathlib.Path, fire: int, stage: int) -> pathlib.Path:
    return sign_dir(root, fire) / f"stage{stage}.safetensors"


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


def prune(root: pathlib.Path, inputs: list[tuple[int, float]], signs_before: int, states_before: int,
          pinned: int) -> None:
    """Remove what neither a pending fire nor a rewind to the pinned checkpoint can read (link.collect
    says which): shipped batches of steps outside every [lo, hi) of `inputs`, θ outside them that no
    kept step's delta chain reaches (module docstring), signs of fires before `signs_before`, and
    states of fires before `states_before` but the `pinned` fire's and the newest two (read_state's
    fallback)."""
    def kept(step: int) -> bool:
        return any(lo <= step < hi for lo, hi in inputs)
    thetas = steps_in(root / "theta")
    chains = set()
    for lo, hi in inputs:   # within a range each θ's base is the previous shipped step: one chain to follow
        first = next((s for s in thetas if lo <= s < hi), None)
        while first is not None and first not in chains:
            chains.add(first)
            first = theta_base(root, first)
    for step in thetas:
        if not kept(step) and step not in chains:
            shutil.rmtree(root / "theta" / f"step{step:08d}", ignore_errors=True)
    for step in steps_in(root / "batch", ".safetensors"):
        if not kept(step):
            _remove_batch(root, step)
    for f in published_fires(root):
        if f < signs_before:
            shutil.rmtree(sign_dir(root, f), ignore_errors=True)
    for f in steps_in(root / "state", ".safetensors")[:-2]:
        if f < states_before and f != pinned:
            _remove_state(root, f)


def theta_base(root: pathlib.Path, step: int) -> int | None:
    """The step θ(step) is a delta against; None for a keyframe (or an unreadable delta)."""
    try:
        return int(metadata(delta_path(root, step, 0))["base"])
    except (MailboxError, KeyError, ValueError):
        return None


def _input_steps(root: pathlib.Path) -> list[int]:
    return sorted(set(steps_in(root / "theta")) | set(steps_in(root / "batch", ".safetensors")))


def _remove_inputs(root: pathlib.Path, step: int) -> None:
    """θ(step) of every stage and the batch it generated (shipped together, rewound together)."""
    shutil.rmtree(root / "theta" / f"step{step:08d}", ignore_errors=True)
    _remove_batch(root, step)


def _remove_batch(root: pathlib.Path, step: int) -> None:
    batch_path(root, step).unlink(missing_ok=True)


def write_state(root: pathlib.Path, fire: int, tensors: dict[str, torch.Tensor], keep: int = 2) -> None:
    """The anchor's state after fire f, in a file of its own; the `keep` newest and those of the
    pinned fire on are kept (a resume may rewind to them). A state that does not check out (a disk
    that lost the rename, a truncated copy) leaves the previous fire's to fall back to (read_state)."""
    write_tensors(state_path(root, fire), fire, tensors)
    pinned = read_pin(root)["fire"]
    for f in steps_in(root / "state", ".safetensors")[:-keep]:
        if pinned < 0 or f < pinned:   # a resume rewinds to the pinned fire at the earliest
            _remove_state(root, f)


def _remove_state(root: pathlib.Path, fire: int) -> None:
    state_path(root, fire).unlink(missing_ok=True)


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


def theta_shapes(root: pathlib.Path, step: int, stage: int) -> dict[str, tuple]:
    """θ(step)'s tensor names of one stage in the stage's order, with their shapes: from its delta's
    metadata, or its keyframe's."""
    d = delta_path(root, step, stage)
    path, key = (d, "shapes") if d.is_file() else (theta_path(root, step, stage), "tensors")
    try:
        return {n: tuple(v) for n, v in json.loads(metadata(path)[key]).items()}
    except (KeyError, ValueError) as e:
        raise MailboxError(f"{path}: unreadable metadata ({e})") from None


# ---- the one file format -------------------------------------------------------------------
def _digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for n, t in tensors.items():
        h.update(n.encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _bytes_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)


def write_file(path: pathlib.Path, step: int, tensors: dict[str, torch.Tensor], **meta) -> None:
    """`tensors` and the metadata of the module docstring (with `meta`) as one safetensors file, written atomically."""
    tensors = {n: t.detach().contiguous().cpu() for n, t in tensors.items()}
    head = {"format": FORMAT, "version": VERSION, "step": str(step), "sha256": _digest(tensors),
            "tensors": json.dumps({n: list(t.shape) for n, t in tensors.items()})}
    write_atomic(path, save(tensors, metadata={**head, **{k: str(v) for k, v in meta.items()}}))


def metadata(path: pathlib.Path) -> dict[str, str]:
    """A mailbox file's metadata, from its header alone (not its tensors: nothing is checked beyond the format)."""
    try:
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            if n > os.fstat(f.fileno()).st_size - 8:
                raise ValueError(f"a header of {n} bytes")
            meta = json.loads(f.read(n)).get("__metadata__") or {}
    except FileNotFoundError:
        raise MailboxError(f"{path}: missing") from None
    except (OSError, struct.error, ValueError, AttributeError) as e:
        raise MailboxError(f"{path}: corrupt or truncated file ({e})") from None
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise MailboxError(f"{path}: not a mailbox file of version {VERSION}")
    return meta


def read_file(path: pathlib.Path, step: int | None = None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """→ (the tensors in the order written, the metadata), after checking the format, `step` (when
    given), the tensors' names and shapes and their sha256."""
    meta = metadata(path)
    if step is not None and meta.get("step") != str(step):
        raise MailboxError(f"{path}: written for step {meta.get('step')}, expected {step}")
    try:
        got = load(path.read_bytes())
        shapes = json.loads(meta["tensors"])
        tensors = {n: got[n] for n in shapes}
    except Exception as e:   # safetensors' own error type is not importable across its versions
        raise MailboxError(f"{path}: corrupt or truncated file ({e})") from None
    if set(got) != set(shapes) or any(list(t.shape) != shapes[n] for n, t in tensors.items()):
        raise MailboxError(f"{path}: tensors do not match its metadata's shapes")
    if _digest(tensors) != meta.get("sha256"):
        raise MailboxError(f"{path}: sha256 mismatch (corrupt file)")
    return tensors, meta


# ---- tensors (θ and rollout batches) -------------------------------------------------------
def write_tensors(path: pathlib.Path, step: int, tensors: dict[str, torch.Tensor]) -> None:
    write_file(path, step, tensors)


def read_tensors(path: pathlib.Path, step: int, shapes: dict[str, tuple] | None = None) -> dict[str, torch.Tensor]:
    """The tensors of `path`, checked (read_file), and against this stage's `shapes` when given."""
    tensors, _ = read_file(path, step)
    if shapes is not None and {n: tuple(t.shape) for n, t in tensors.items()} != {n: tuple(v) for n, v in shapes.items()}:
        raise MailboxError(f"{path}: tensor names/shapes differ from this stage's parameters")
    return tensors


def write_delta(path: pathlib.Path, step: int, base: int, blob: bytes, shapes: dict[str, tuple],
                dtype: torch.dtype) -> None:
    """A θ delta: sync/delta.py's blob of every tensor in `shapes`' order against θ(base)."""
    write_file(path, step, {"blob": _bytes_tensor(blob)}, base=base,
               dtype=str(dtype).removeprefix("torch."), shapes=json.dumps({n: list(v) for n, v in shapes.items()}))


def read_theta(root: pathlib.Path, step: int, stage: int, shapes: dict[str, tuple] | None = None,
               known: dict[int, dict[str, torch.Tensor]] | None = None) -> dict[str, torch.Tensor]:
    """θ(step) of one stage, rebuilt through its delta chain from the nearest keyframe or from a
    step in `known` (step → this stage's tensors, held by the reader)."""
    known, chain = known or {}, []
    while step not in known and delta_path(root, step, stage).is_file():
        blob, meta = read_file(delta_path(root, step, stage), step)
        chain.append((step, blob["blob"], meta))
        step = int(meta["base"])
    cur = known[step] if step in known else read_tensors(theta_path(root, step, stage), step, shapes)
    for s, blob, meta in reversed(chain):
        path, theta = delta_path(root, s, stage), json.loads(meta["shapes"])
        if set(theta) != set(cur):
            raise MailboxError(f"{path}: its tensors differ from θ({meta['base']})'s")
        try:
            news = decode_all([cur[n] for n in theta], blob.numpy().tobytes(), [tuple(theta[n]) for n in theta],
                              getattr(torch, meta["dtype"]))
        except (ValueError, AttributeError) as e:
            raise MailboxError(f"{path}: malformed delta ({e})") from None
        cur = dict(zip(theta, news))
    if shapes is not None and {n: tuple(t.shape) for n, t in cur.items()} != {n: tuple(v) for n, v in shapes.items()}:
        raise MailboxError(f"{theta_path(root, step, stage)}: tensor names/shapes differ from this stage's parameters")
    return cur


# ---- sign(M) -----------------------------------------------------------------------------
def write_sign(path: pathlib.Path, step: int, stage: int, shapes: dict[str, tuple], bits: bytes, numel: int,
               zeros: torch.Tensor | None = None) -> None:
    """sign(M) of one stage: the packed bits and, only where M has zeros, their runs (sign.zero_runs)."""
    runs = {"zero_runs": zeros.to(torch.int64).contiguous()} if zeros is not None and len(zeros) else {}
    write_file(path, step, {"bits": _bytes_tensor(bits), **runs}, stage=stage, numel=numel,
               layout=layout_digest(shapes).hex())


def read_sign(path: pathlib.Path, stage: int, shapes: dict[str, tuple],
              newer_than: int = -1) -> tuple[int, bytes, int, torch.Tensor]:
    """→ (step, bits, numel, zero runs (R, 2)). Rejects another format or version, truncation,
    checksum, runs outside the stage, a stale step (≤ newer_than) and a layout (names, shapes) other
    than this stage's."""
    tensors, meta = read_file(path)
    try:
        step, st, numel, bits = int(meta["step"]), int(meta["stage"]), int(meta["numel"]), tensors["bits"]
    except (KeyError, ValueError) as e:
        raise MailboxError(f"{path}: not a sign file ({e})") from None
    if bits.numel() != (numel + 7) // 8:
        raise MailboxError(f"{path}: truncated payload ({bits.numel()} of {(numel + 7) // 8} bytes)")
    runs = tensors.get("zero_runs", torch.zeros(0, 2, dtype=torch.int64))
    if (runs.dtype != torch.int64 or runs.dim() != 2 or runs.shape[1] != 2
            or (len(runs) and (runs.min() < 0 or (runs.sum(1) > numel).any()))):
        raise MailboxError(f"{path}: zero runs outside the stage's {numel} parameters")
    if st != stage or meta.get("layout") != layout_digest(shapes).hex():
        raise MailboxError(f"{path}: written for stage {st} with another parameter layout; this is stage {stage}")
    if step <= newer_than:
        raise MailboxError(f"{path}: stale sign of step {step} (already hold step {newer_than})")
    return step, bits.numpy().tobytes(), numel, runs
