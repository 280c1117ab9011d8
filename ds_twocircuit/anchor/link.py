"""The trainer's side of the anchor circuit: ship θ and batches, bring a published sign to every rank.

Only global rank 0 touches the mailbox (it holds the dense θ(t) its sampler was synced with), so the
trainer's other nodes need no shared filesystem; the anchor only needs a file transport to rank 0's
mailbox. `step(t)`, before step t's update, on every rank:

    ship        rank 0: if t = max(0, f − K) for a fire f of this run, write θ(t) per stage (as the
                sampler holds it: the weights that generated the batch) and the batch θ(t) generated
                (a keyed share of its prompt groups with `anchor.replay_fraction` < 1), then one
                request per such fire (mailbox.py). θ goes as lossless deltas against the previous
                shipped step, with a keyframe now and then (mailbox.py says when)
    pick        rank 0: the newest published fire f ≤ t whose files all check out (checksums,
                layout; a bad file is logged and skipped, never sent); sync mode first waits for the
                fire due at t. The pick is broadcast (one int), so every rank switches at the same step
    distribute  each rank gets its own stage's bits from rank 0 (p2p, ⌈P_rank/8⌉ bytes), plus the
                tied head's copy of the embedding's bits on the last stage; lowrank bases go to all

and returns the newly adopted `Sign` (None when the held one stays) with the step's anchor metrics.
A managed anchor (process.py) that dies is restarted at the next fire while the held sign ages; once
it has used `anchor.max_restarts`, `anchor.on_failure` decides: continue (the held sign stays,
`anchor/alive` reads 0 every step after) or stop (every rank raises AnchorGaveUp at the same step).
An external anchor that does not answer within `anchor.timeout` seconds is waited for no longer.

Checkpoints: each trainer checkpoint records the held fire; `checkpointed` pins it in the mailbox
(what the anchor and `collect` must keep to rewind to it). On --resume rank 0 ends a managed anchor
left from the crashed run, rewinds the mailbox to the checkpoint (mailbox.rewind) and every rank
takes up the checkpoint's sign again (`restore`), so the run continues the uninterrupted trajectory;
rank 0 takes the newest θ shipped before the checkpoint back from the mailbox, so its next delta
(and its keyframe schedule) is the uninterrupted run's.
"""
import math
import pathlib
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from ..pipeline import comm, traffic
from ..sync.delta import encode_all
from . import mailbox as mb
from .forecast import fires_replaying, forecast_steps, replay_groups, weights_step
from .process import AnchorProcess
from .sign import pack_bits, signs_of, unpack_bits, zero_runs


STOP = -2      # the broadcast pick that ends the run (anchor.on_failure=stop)


class AnchorGaveUp(RuntimeError):
    """The managed anchor used its restarts and anchor.on_failure is stop."""


@dataclass
class Sign:
    fire: int
    signs: dict[str, torch.Tensor]         # HF name → int8 sign(M) ∈ {−1, 0, +1} of the parameter's shape, on the device
    bases: dict[int, torch.Tensor] | None  # lowrank: cut layer → Q refreshed at this fire


class AnchorLink:
    def __init__(self, tc, run_dir: pathlib.Path, pipeline, config_json: str, shapes: dict | None,
                 resume: tuple[int, int] | None = None):
        """`shapes`: HF name → (shape, dtype) of the whole model (rank 0's sampler); None elsewhere.
        `resume`: (held fire, step) of the checkpoint a resumed run starts from."""
        self.a, self.steps, self.shapes = tc.anchor, tc.train.steps, shapes
        self.group_size, self.seed = tc.grpo.group_size, tc.train.seed
        self.pipe, self.lowrank_cuts = pipeline.pipe, sorted(pipeline.codec.cuts) if tc.codec.name == "lowrank" else []
        self.root = pathlib.Path(self.a.mailbox or run_dir / "anchor")
        self.rank0 = dist.get_rank() == 0
        self.held = -1                      # the fire whose sign every rank holds
        self.held_bits = None               # rank 0: sign(M) > 0 of the held fire, every parameter, packed
        self.pin = resume          # (held fire, step) of the newest checkpoint; None before one
        grid = pipeline.engine.grid
        self.stage_of_rank = {grid.stage_to_global(stage_id=s, data=d): s
                              for s in range(grid.pipe_parallel_size) for d in range(grid.data_parallel_size)}
        self.process = None
        if self.rank0:
            self.root.mkdir(parents=True, exist_ok=True)
            (self.root / "STOP").unlink(missing_ok=True)
            (self.root / "config.json").write_text(config_json)
            if not self.a.external:
                self.process = AnchorProcess(self.root, self.a.max_restarts, self.a.device)
            if self.process is not None:
                self.process.stop_stale()
            # a fresh run rewinds to nothing: an earlier run's files in this mailbox are not its own
            gone = mb.rewind(self.root, *(resume or (-1, 0)), pin=resume is not None)
            if resume or any(gone.values()):
                print(f"[anchor] rewound the mailbox to fire {resume[0] if resume else -1} (checkpoint after step "
                      f"{resume[1] if resume else 0}): removed " + ", ".join(f"{n} {k}" for k, n in gone.items()),
                      flush=True)
            self.shipped, self.chain_bytes, self.keyframe_bytes = self._last_shipped(resume[1] if resume else 0)
            if self.process is not None:
                self.process.start()

    def step(self, t: int, theta: dict | None, rollout, kl_coef: float) -> tuple[Sign | None, dict]:
        """Ship for step t (rank 0) and adopt the sign rank 0 picks; → (the new sign or None, metrics)."""
        up = self._ship(t, theta, rollout, kl_coef) if self.rank0 else 0
        traffic.handed_to_anchor("anchor_theta", up)
        fire, staged, waited = self._pick(t) if self.rank0 else (-1, None, 0.0)
        if self.rank0 and self.process is not None and self.process.gave_up and self.a.on_failure == "stop":
            fire = STOP
        choice = comm.broadcast_scalar(fire, torch.int64)
        if choice == STOP:      # every rank ends here, at the same step
            raise AnchorGaveUp(f"the managed anchor exited after {self.a.max_restarts} restart(s) (anchor.max_restarts); "
                               "anchor.on_failure=stop ends the run (continue: train on with the held sign)")
        new, down, flips = None, 0, None
        if choice > self.held:
            new, down, flips = self._distribute(choice, staged)
            self.held = new.fire
        out = {**({"anchor/sign_flip_frac": flips} if flips is not None else {}),"anchor/bytes_up": float(up), "anchor/bytes_down": float(down), "anchor/bytes": float(up + down),
               "anchor/wait": waited, "anchor/restarts": float(self.process.restarts if self.process else 0),
               "anchor/alive": 0.0 if self.process is not None and self.process.gave_up else 1.0}
        if self.held >= 0:
            out.update({"anchor/age": float(t - weights_step(self.held, self.a.staleness)), "anchor/fire": float(self.held)})
        return new, out

    def restore(self, fire: int) -> Sign | None:
        """Every rank takes up the sign of `fire` again (a resumed checkpoint's); None when it held
        none, or its files no longer check out (then the run goes on without, and says so)."""
        staged = None
        if self.rank0 and fire >= 0:
            try:
                staged = self._read_fire(fire)
            except mb.MailboxError as e:
                print(f"[anchor] the checkpoint's sign (fire {fire}) is unusable: {e}; resuming without it",
                      file=sys.stderr, flush=True)
        choice = comm.broadcast_scalar(fire if staged is not None else -1, torch.int64)
        if choice < 0:
            return None
        new, _, _ = self._distribute(choice, staged)
        self.held = new.fire
        return new

    def checkpointed(self, step: int) -> None:
        """Rank 0, after a checkpoint of `step` steps is complete: pin its held fire in the mailbox."""
        if self.rank0:
            mb.write_pin(self.root, self.held, step)
            self.pin = (self.held, step)

    def ships_at(self, t: int) -> bool:
        """Whether step t ships θ(t) (then rank 0 must hold the dense weights of step t)."""
        return bool(fires_replaying(t, self.a.every, self.a.staleness, self.steps))

    def close(self) -> None:
        if self.rank0:
            (self.root / "STOP").touch()
            if self.process is not None:
                self.process.wait()

    def collect(self) -> None:
        """Rank 0: drop what the mailbox no longer needs. A pending fire reads inputs from the held
        fire's weights step minus one cadence (the forecast's older θ) on; a resume rewinds to the
        pinned checkpoint (fire h after s steps) and recomputes the fires after h whose weights step
        lies before s, so the inputs of [weights step of h − c, s) stay too, and h's sign and state.
        Those in between go: a rewind removes them, and no pending fire reads them. A checkpoint that
        held no sign (h = −1) rewinds to fire 0: everything stays until the next one."""
        if not self.rank0 or self.held < 0 or (self.pin is not None and self.pin[0] < 0):
            return
        def oldest_read(fire: int) -> int:   # by the fires after `fire`: its weights step − c
            return weights_step(fire, self.a.staleness) - self.a.every
        inputs = [(oldest_read(self.held), math.inf)]
        if self.pin is not None:
            inputs.append((oldest_read(self.pin[0]), self.pin[1]))
        pinned = self.held if self.pin is None else self.pin[0]
        mb.prune(self.root, inputs, signs_before=min(self.held, pinned), states_before=self.held, pinned=pinned)

    # ---- rank 0 -----------------------------------------------------------------------------
    def _ship(self, t: int, theta: dict, rollout, kl_coef: float) -> int:
        """θ(t) per stage and (a share of) the batch θ(t) generated, then the requests; → bytes
        written. kl_coef is the β step t trains with (the drift controller moves it), so the anchor
        replays the same loss."""
        fires = fires_replaying(t, self.a.every, self.a.staleness, self.steps)
        if not fires:
            return 0
        written = self._ship_theta(t, theta)
        groups = rollout.ids_NT.shape[0] // self.group_size
        share = rollout.groups(replay_groups(groups, self.a.replay_fraction, self.seed, t), self.group_size)
        path = mb.batch_path(self.root, t)
        mb.write_tensors(path, t, {f: getattr(share, f) for f in share.__dataclass_fields__})
        written += path.stat().st_size
        for f in fires:
            _, older = forecast_steps(f, self.a.staleness, self.a.every)
            mb.write_request(self.root, {"fire": f, "weights_step": t, "older_step": older if self.a.forecast else None,
                                         "stages": self.pipe.num_stages, "every": self.a.every,
                                         "staleness": self.a.staleness, "kl_coef": kl_coef})
        return written

    def _ship_theta(self, t: int, theta: dict) -> int:
        """θ(t) of every stage, whole (a keyframe) or as deltas against the previous shipped step;
        → bytes written."""
        now = [{n: theta[n] for n in names} for names in self.pipe.hf_names_per_stage()]
        keyframe = self.shipped is None or self.chain_bytes >= mb.KEYFRAME_CHAIN * self.keyframe_bytes
        written = 0
        for i, mine in enumerate(now):
            if keyframe:
                path = mb.theta_path(self.root, t, i)
                mb.write_tensors(path, t, mine)
            else:
                base, before = self.shipped
                blob, _ = encode_all([before[i][n] for n in mine], list(mine.values()))
                path = mb.delta_path(self.root, t, i)
                mb.write_delta(path, t, base, blob, {n: tuple(x.shape) for n, x in mine.items()},
                               next(iter(mine.values())).dtype)
            written += path.stat().st_size
        if keyframe:
            self.keyframe_bytes, self.chain_bytes = written, 0
        else:
            self.chain_bytes += written
        self.shipped = (t, now)
        return written

    def _last_shipped(self, before: int) -> tuple[tuple[int, list[dict]] | None, int, int]:
        """Rank 0 at start: the newest θ shipped before step `before` still in the mailbox (a resume's
        rewound one) → ((step, per-stage tensors) or None, delta bytes since its keyframe, that
        keyframe's bytes): where the uninterrupted run's shipping stood."""
        steps = [s for s in mb.steps_in(self.root / "theta") if s < before]
        if not steps:
            return None, 0, 0
        stages = range(self.pipe.num_stages)
        try:
            now = [mb.read_theta(self.root, steps[-1], i) for i in stages]
        except mb.MailboxError as e:
            print(f"[anchor] θ({steps[-1]}) unreadable ({e}): the next θ ships whole", file=sys.stderr, flush=True)
            return None, 0, 0
        chain, step = 0, steps[-1]
        while (base := mb.theta_base(self.root, step)) is not None:
            chain += sum(mb.delta_path(self.root, step, i).stat().st_size for i in stages)
            step = base
        return (steps[-1], now), chain, sum(mb.theta_path(self.root, step, i).stat().st_size for i in stages)

    def _pick(self, t: int) -> tuple[int, tuple | None, float]:
        """The newest published fire ≤ t (sync mode: after waiting for the fire due at t), its
        checked files (stage bits, bytes read, bases), and the seconds waited; the held fire and
        None when there is nothing newer that checks out."""
        due, start = (t // self.a.every) * self.a.every, time.perf_counter()
        if self.a.mode == "sync" and due > self.held:
            while not mb.sign_dir(self.root, due).is_dir():
                if self.process is not None and self.process.restart_if_exited(self.held):
                    break
                if time.perf_counter() - start > self.a.timeout:
                    print(f"[anchor] no sign for fire {due} after {self.a.timeout:.0f} s; holding fire {self.held}",
                          file=sys.stderr, flush=True)
                    break
                time.sleep(0.02)
        elif self.process is not None:
            self.process.restart_if_exited(self.held)
        waited = time.perf_counter() - start
        ready = [f for f in mb.published_fires(self.root) if f <= t]
        if not ready or max(ready) <= self.held:
            return self.held, None, waited
        f = max(ready)
        try:   # check every file before anyone waits for the bits: a bad file is skipped, not fatal
            return f, self._read_fire(f), waited
        except mb.MailboxError as e:
            print(f"[anchor] fire {f} rejected: {e}; holding fire {self.held}", file=sys.stderr, flush=True)
            return self.held, None, waited

    def _read_fire(self, f: int) -> tuple:
        """Fire f's checked files → (stage signs, bytes read, bases or None); MailboxError if one is bad."""
        path = mb.sign_dir(self.root, f) / "bases.safetensors"
        bases = mb.read_tensors(path, f) if self.lowrank_cuts else None
        if bases is not None:
            traffic.received("anchor_signs", traffic.ANCHOR, path.stat().st_size)
        return (*self._read_stage_signs(f), bases)

    def _read_stage_signs(self, f: int) -> tuple[dict[str, torch.Tensor], int]:
        """Every stage's sign file, checked against that stage's layout → (name → flat int8 sign, bytes read)."""
        out, read = {}, 0
        for s, names in enumerate(self.pipe.hf_names_per_stage()):
            shapes = {n: tuple(self.shapes[n][0]) for n in names}
            path = mb.sign_path(self.root, f, s)
            _, bits, numel, runs = mb.read_sign(path, s, shapes, newer_than=self.held)
            read += path.stat().st_size
            traffic.received("anchor_signs", traffic.ANCHOR, path.stat().st_size)
            signs = signs_of(unpack_bits(bits, numel), runs)
            out.update(zip(shapes, signs.split([math.prod(shp) for shp in shapes.values()])))
        return out, read

    # ---- every rank -------------------------------------------------------------------------
    def _distribute(self, f: int, staged: tuple | None) -> tuple[Sign, int, float | None]:
        """Every rank ends with its stage's signs of fire f on its device (and the bases); → (Sign,
        bytes rank 0 read, on rank 0 the share of parameters whose sign bit differs from the fire held
        before, None for the first). On the wire: 1 bit a parameter, and the runs of M = 0 where it
        has any."""
        names = self.pipe.sign_names(self.pipe.stage_id)
        params = self.pipe.hf_parameters_all()
        numel = sum(params[n].numel() for n in names)
        read, flips = 0, None
        if self.rank0:
            stage_signs, read, _ = staged
            for r in range(1, dist.get_world_size()):
                theirs = torch.cat([stage_signs[n] for n in self.pipe.sign_names(self.stage_of_rank[r])])
                comm.send_bytes(pack_bits(theirs > 0), r)
                comm.send_bytes(zero_runs(theirs).numpy().tobytes(), r)
            mine = torch.cat([stage_signs[n] for n in names])
            flips = self._flips(stage_signs)
        else:
            bits, _ = comm.recv_bytes(0, kind="signs")
            runs, _ = comm.recv_bytes(0, kind="signs")
            runs = torch.frombuffer(bytearray(runs), dtype=torch.int64).view(-1, 2) if runs else torch.zeros(0, 2, dtype=torch.int64)
            mine = signs_of(unpack_bits(bits, numel), runs)
        flat = mine.to(comm.device()).split([params[n].numel() for n in names])
        signs = {n: b.view(params[n].shape) for n, b in zip(names, flat)}
        bases = None
        if self.lowrank_cuts:
            qs = [staged[2][f"cut{l}"] for l in self.lowrank_cuts] if self.rank0 else None
            bases = dict(zip(self.lowrank_cuts, comm.broadcast_tensors(qs, len(self.lowrank_cuts), kind="signs")))
        return Sign(f, signs, bases), read, flips

    def _flips(self, stage_signs: dict[str, torch.Tensor]) -> float | None:
        """Rank 0: the share of sign bits that differ from the held fire's (how compressible a code
        against the last signs would be); keeps these bits, packed a stage at a time, as the held ones."""
        bits = [np.packbits((torch.cat([stage_signs[n].reshape(-1) for n in names]) > 0).cpu().numpy(),
                            bitorder="little") for names in self.pipe.hf_names_per_stage()]
        before, self.held_bits = self.held_bits, bits
        if before is None:
            return None
        numel = sum(stage_signs[n].numel() for names in self.pipe.hf_names_per_stage() for n in names)
        return float(sum(int(np.bitwise_count(b ^ a).sum()) for b, a in zip(bits, before))) / numel
