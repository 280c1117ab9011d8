"""The trainer's side of the anchor circuit: ship θ and batches, adopt published signs on every rank.

Only global rank 0 touches the mailbox (it already holds the dense θ(t) in its sampler), so the
trainer's other nodes need no shared filesystem; the anchor only needs a file transport to rank 0's
mailbox. Per step t (before the update):

    ship    rank 0: if t = max(0, f − K) for a fire f of this run, write θ(t) per stage and the batch
            θ(t) generated, then one request per such fire (mailbox.py)
    adopt   rank 0 picks the sign to hold: the newest published fire f ≤ t (sync mode first waits for
            the fire due at t); the choice is broadcast (one int), so every rank switches at the same
            step; each rank gets its own stage's bits from rank 0 (p2p, ⌈P_rank/8⌉ bytes), plus the
            tied head's copy of the embedding's bits on the last stage; lowrank bases go to everyone

A managed anchor (the default) is a child of rank 0 with its own log (`anchor.log`); when it dies the
trainer keeps the held sign, logs its growing age, and restarts it at the next fire (it resumes M
from its own state file). An external anchor that does not answer within `anchor.timeout` seconds is
waited for no longer: the held sign stays. Rank 0 checks every file of a fire (checksums, layout)
before the choice is broadcast, so a corrupt or mismatched sign is logged and skipped, never sent.
"""
import os
import pathlib
import shutil
import subprocess
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

from . import mailbox as mb
from .forecast import fires_replaying, forecast_steps, weights_step

_DIST_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT", "CROSS_RANK",
             "CROSS_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE", "TORCHELASTIC_RUN_ID")


class AnchorLink:
    def __init__(self, tc, run_dir: pathlib.Path, engine, pipe, correction, config_json: str, shapes: dict | None):
        """`shapes`: HF name → (shape, dtype) of the whole model (rank 0's sampler); None elsewhere."""
        self.a, self.steps, self.shapes = tc.anchor, tc.train.steps, shapes
        self.engine, self.pipe, self.correction = engine, pipe, correction
        self.codec = pipe.codec
        self.root = pathlib.Path(self.a.mailbox or run_dir / "anchor")
        self.rank0 = dist.get_rank() == 0
        self.held, self.proc, self.restarts, self.waited, self.gave_up = -1, None, 0, 0.0, False
        self.staged = None   # rank 0: (fire, name → bits, bytes read, bases) checked, to send
        self.bytes_up = 0
        grid = engine.grid
        self.stage_of_rank = {grid.stage_to_global(stage_id=s, data=d): s
                              for s in range(grid.pipe_parallel_size) for d in range(grid.data_parallel_size)}
        if self.rank0:
            self.root.mkdir(parents=True, exist_ok=True)
            (self.root / "STOP").unlink(missing_ok=True)
            (self.root / "config.json").write_text(config_json)
            if not self.a.external:
                self._start()

    # ---- the managed process ----------------------------------------------------------------
    def _start(self) -> None:
        env = {k: v for k, v in os.environ.items() if k not in _DIST_ENV}
        env["OMP_NUM_THREADS"] = "1"
        log = open(self.root / "anchor.log", "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "ds_twocircuit.anchor.worker", "--mailbox", str(self.root),
                                      "--parent-pid", str(os.getpid())], env=env, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        (self.root / "anchor.pid").write_text(str(self.proc.pid))

    def _alive(self) -> bool:
        """Managed: the child runs (else restart it, within `max_restarts`). External: always assumed."""
        if self.gave_up:
            return False
        if self.proc is None or self.proc.poll() is None:
            return True
        print(f"[anchor] the anchor process exited with {self.proc.returncode}; holding sign of fire {self.held}",
              file=sys.stderr, flush=True)
        if self.restarts < self.a.max_restarts:
            self.restarts += 1
            self._start()
        else:
            print(f"[anchor] {self.restarts} restarts used (anchor.max_restarts): training on without new signs",
                  file=sys.stderr, flush=True)
            self.gave_up = True
        return False

    def close(self) -> None:
        if self.rank0:
            (self.root / "STOP").touch()
            if self.proc is not None:
                try:
                    self.proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    self.proc.kill()

    # ---- shipping (rank 0) ------------------------------------------------------------------
    def ship(self, t: int, theta: dict[str, torch.Tensor], rollout, kl_coef: float) -> None:
        """θ(t) per stage and the batch θ(t) generated, then the requests (rank 0); kl_coef is the β
        step t trains with (the drift controller moves it), so the anchor replays the same loss."""
        self.bytes_up = 0
        fires = fires_replaying(t, self.a.every, self.a.staleness, self.steps)
        if not fires:
            return
        for i, names in enumerate(self.pipe.hf_names_per_stage()):
            path = mb.theta_path(self.root, t, i)
            mb.write_tensors(path, t, {n: theta[n] for n in names})
            self.bytes_up += path.stat().st_size
        path = mb.batch_path(self.root, t)
        mb.write_tensors(path, t, {f: getattr(rollout, f) for f in rollout.__dataclass_fields__})
        self.bytes_up += path.stat().st_size
        for f in fires:
            _, older = forecast_steps(f, self.a.staleness, self.a.every)
            older = older if self.a.forecast else None
            mb.write_request(self.root, {"fire": f, "weights_step": t, "older_step": older, "stages": self.pipe.num_stages,
                                         "every": self.a.every, "staleness": self.a.staleness, "kl_coef": kl_coef})

    # ---- adoption (every rank) --------------------------------------------------------------
    def adopt(self, t: int) -> dict:
        """Switch to the sign rank 0 picks for step t; → this step's anchor metrics (rank 0)."""
        choice = torch.tensor([self._choose(t) if self.rank0 else -1], dtype=torch.int64)
        dist.broadcast(choice, src=0)
        f, down = int(choice), 0
        if f > self.held:
            down = self._receive(f)
            self.held = f
        out = {"anchor/bytes_up": float(self.bytes_up), "anchor/bytes_down": float(down),
               "anchor/bytes": float(self.bytes_up + down), "anchor/wait": self.waited,
               "anchor/restarts": float(self.restarts)}
        if self.held >= 0:
            out.update({"anchor/age": float(t - weights_step(self.held, self.a.staleness)), "anchor/fire": float(self.held)})
        return out

    def _choose(self, t: int) -> int:
        """Rank 0: the newest published fire ≤ t; in sync mode wait for the fire due at t first."""
        due, start = (t // self.a.every) * self.a.every, time.perf_counter()
        if self.a.mode == "sync" and due > self.held:
            while not mb.sign_dir(self.root, due).is_dir():
                if not self._alive():
                    break
                if time.perf_counter() - start > self.a.timeout:
                    print(f"[anchor] no sign for fire {due} after {self.a.timeout:.0f} s; holding fire {self.held}",
                          file=sys.stderr, flush=True)
                    break
                time.sleep(0.02)
        else:
            self._alive()
        self.waited = time.perf_counter() - start
        ready = [f for f in mb.published_fires(self.root) if f <= t]
        if not ready or max(ready) <= self.held:
            return self.held
        try:   # check every file before anyone waits for the bits: a bad file is skipped, not fatal
            f = max(ready)
            bases = mb.read_tensors(mb.sign_dir(self.root, f) / "bases.safetensors", f) if self.codec.name == "lowrank" else None
            self.staged = (f, *self._read_stage_bits(f), bases)
        except mb.MailboxError as e:
            print(f"[anchor] fire {max(ready)} rejected: {e}; holding fire {self.held}", file=sys.stderr, flush=True)
            return self.held
        return max(ready)

    def _receive(self, f: int) -> int:
        """Every rank ends with `correction.signs` for fire f; → bytes rank 0 read from the mailbox."""
        names = self.pipe.sign_names(self.pipe.stage_id)
        params = self.pipe.hf_parameters_all()
        numel = sum(params[n].numel() for n in names)
        read = 0
        if self.rank0:
            _, stage_bits, read, _ = self.staged
            for r in range(1, dist.get_world_size()):
                s = self.stage_of_rank[r]
                buf = np.packbits(np.concatenate([stage_bits[n] for n in self.pipe.sign_names(s)]), bitorder="little")
                dist.send(torch.from_numpy(buf), dst=r)
            mine = np.concatenate([stage_bits[n] for n in names])
        else:
            buf = torch.empty((numel + 7) // 8, dtype=torch.uint8)
            dist.recv(buf, src=0)
            mine = np.unpackbits(buf.numpy(), count=numel, bitorder="little").astype(bool)
        flat, signs, off = torch.from_numpy(mine), {}, 0
        for n in names:
            signs[n] = flat[off:off + params[n].numel()].view(params[n].shape)
            off += params[n].numel()
        self.correction.signs = signs
        if self.codec.name == "lowrank":
            self._receive_bases()
        return read

    def _read_stage_bits(self, f: int) -> tuple[dict[str, np.ndarray], int]:
        """Rank 0: every stage's sign file, checked against that stage's layout → name → bool array."""
        out, read = {}, 0
        for s, names in enumerate(self.pipe.hf_names_per_stage()):
            shapes = {n: tuple(self.shapes[n][0]) for n in names}
            path = mb.sign_dir(self.root, f) / f"stage{s}.sign"
            _, bits, numel = mb.read_sign(path, s, shapes, newer_than=self.held)
            read += path.stat().st_size
            flat = np.unpackbits(np.frombuffer(bits, dtype=np.uint8), count=numel, bitorder="little").astype(bool)
            off = 0
            for n, shp in shapes.items():
                k = int(np.prod(shp))
                out[n], off = flat[off:off + k], off + k
        return out, read

    def _receive_bases(self) -> None:
        from ..engine import broadcast_tensors
        cuts = sorted(self.codec.cuts)
        qs = None
        if self.rank0:
            qs = [self.staged[3][f"cut{l}"] for l in cuts]
        for layer, q in zip(cuts, broadcast_tensors(qs, len(cuts))):
            self.codec.set_basis(layer, q)

    def collect(self) -> None:
        """Rank 0: drop shipped inputs the anchor can no longer need (older than the held fire's
        weights step minus one cadence, which the forecast may still read) and superseded signs."""
        if not self.rank0 or self.held < 0:
            return
        keep_from = weights_step(self.held, self.a.staleness) - self.a.every
        for sub in ("theta", "batch"):
            for step in mb.steps_in(self.root / sub, "" if sub == "theta" else ".safetensors"):
                if step < keep_from:
                    target = self.root / sub / f"step{step:08d}"
                    if sub == "theta":
                        shutil.rmtree(target, ignore_errors=True)
                    else:
                        for suffix in (".safetensors", ".json"):
                            target.with_suffix(suffix).unlink(missing_ok=True)
        for f in mb.published_fires(self.root):
            if f < self.held:
                shutil.rmtree(mb.sign_dir(self.root, f), ignore_errors=True)
