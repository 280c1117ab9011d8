"""The anchor process: dense replays of shipped (θ, batch) pairs → the memory M → sign(M) per stage.

One process with its own one-stage DeepSpeed pipeline engine in its own torch.distributed world of
size 1 (it never joins the trainer's: DeepSpeed's pipeline barriers would couple the two). It serves
the mailbox directory (layout in mailbox.py); any file transport can carry that directory between
hosts. For each fire request, in fire order:

    θ      ← θ(s), s = max(0, f − K)                 (or θ̂ = θ(s) + (K/c)(θ(s) − θ(s−c)): forecast)
    G_anc  ← ∇ of the GRPO loss on the batch θ(s) generated, codec off, one forward + backward,
             reference = the base model, no optimizer step (passes.dense_gradient, as the probe)
    M      ← β_M·M + (1 − β_M)·G_anc                 (fp32, per tensor; M = 0 before the first fire; memory.py)
    out    ← sign(M), 1 bit per parameter, one file per trainer stage (sign.py, mailbox.py)

With the lowrank codec each cut's basis is refreshed from the replay's activations X at that cut by
one subspace iteration, Q ← orth(Xᵀ(X·Q)) (the first fire takes X's top-k right singular vectors),
and shipped beside the sign. M and the bases are saved after every fire, before its sign is
published (state/step{f}.safetensors; the last two and those the trainer's checkpoint pins are
kept), so a restarted anchor resumes from the newest that checks out, also when it was killed
mid-write, and publishes that fire's sign again if it had not yet. A resumed trainer rewinds the
mailbox to its checkpoint (mailbox.rewind); a running anchor sees rewind.json change and reloads.

Its DeepSpeed config keeps the trainer's activation checkpointing (`INHERITED`: the same recomputed
segments of decoder layers), and log-probs are made from the head a chunk at a time
(grpo/logprobs.py). It stays in fp32 without ZeRO whatever the trainer's precision: it reads each
parameter's own .grad after a forward and backward without a step (passes.dense_gradient), which
DeepSpeed's bf16 and ZeRO optimizers replace by flat partitions. A managed anchor runs on the
node's GPU `anchor.device` (its process sees only that one: CUDA_VISIBLE_DEVICES), on the 1.5B
recipe's 8 stages a ninth; an external one on the device its own launch gives it.
"""
import argparse
import copy
import dataclasses
import math
import os
import pathlib
import shutil
import time

import torch

from ..pipeline import comm, passes
from ..pipeline.calibration import recording_cuts
from ..codec.geometry import compressed_cuts, keep_count
from ..codec.lowrank import refresh_basis, top_basis
from ..pipeline.engine import build_pipeline, init_distributed
from ..run.faults import fault_point
from ..grpo.loss import LossCoefs
from ..grpo.rollouts import Rollout
from . import mailbox as mb
from .forecast import forecast, replay_groups
from .memory import update_memory
from .sign import pack_signs, zero_runs


# the trainer's DeepSpeed sections the anchor's one-stage engine keeps
INHERITED = ("pipeline", "activation_checkpointing")


class AnchorWorker:
    def __init__(self, root: pathlib.Path, model_dir: str, tc, ds: dict):
        self.root, self.tc = pathlib.Path(root), tc
        one = copy.deepcopy(tc)
        one.model.layers_per_stage = [sum(tc.model.layers_per_stage)]
        one.codec.name = "dense"
        n = len(replay_groups(tc.grpo.prompts_per_step, tc.anchor.replay_fraction, 0, 0)) * tc.grpo.group_size
        micro = math.gcd(n, ds.get("train_micro_batch_size_per_gpu", n))
        ds1 = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": n // micro,
               "train_batch_size": n, "gradient_clipping": 0.0, "steps_per_print": 10 ** 9,
               "optimizer": ds.get("optimizer", {"type": "AdamW", "params": {"lr": 0.0, "torch_adam": True}}),
               **{k: copy.deepcopy(ds[k]) for k in INHERITED if k in ds}}
        self.p = build_pipeline(model_dir, one, ds1)
        self.params = self.p.pipe.hf_parameters()
        self.base = [q.detach().clone() for q in self.p.pipe.parameters()]
        self.coefs = LossCoefs.from_config(tc.grpo)
        d = self.p.pipe.config.hidden_size
        self.cuts = compressed_cuts(tc.codec.boundaries, tc.model.layers_per_stage)   # the trainer's cuts and k
        self.k = keep_count(tc.codec.keep, tc.codec.keep_ratio, d)
        self.M: dict[str, torch.Tensor] = {}
        self.bases: dict[int, torch.Tensor] = {}
        self.thetas: dict[int, list[dict]] = {}   # step → per-stage θ rebuilt lately: the next delta's base
        self.done = -1
        self._rewind_seen = self._rewind_mark()
        self._load_state()

    # ---- state ------------------------------------------------------------------------------
    def _load_state(self) -> None:
        fire, saved, rejected = mb.read_state(self.root)
        for why in rejected:
            log(f"state rejected: {why}")
        if fire < 0:
            return
        dev = comm.device()     # the file's tensors are read on the host; the gradients they meet are not
        self.M = {n: t.to(dev) for n, t in saved.items() if not n.startswith("basis.")}
        self.bases = {int(n.split("cut")[1]): t.to(dev) for n, t in saved.items() if n.startswith("basis.")}
        self.done = fire
        log(f"resumed M from {mb.state_path(self.root, fire)} (fire {fire}, {len(self.M)} tensors)")
        if not mb.sign_dir(self.root, fire).is_dir():   # killed between its state and its sign
            self._publish_again(fire)

    def _publish_again(self, fire: int) -> None:
        req = next((r for r in mb.pending_requests(self.root, fire - 1) if r["fire"] == fire), None)
        try:
            if req is None:
                raise mb.MailboxError(f"no request for fire {fire}")
            self._publish(fire, [mb.theta_shapes(self.root, req["weights_step"], i)
                                 for i in range(req["stages"])])
            log(f"published fire {fire} again (its state was saved, its sign was not)")
        except mb.MailboxError as e:
            log(f"cannot publish fire {fire} again: {e}")

    def _rewind_mark(self) -> bytes:
        path = self.root / "rewind.json"
        return path.read_bytes() if path.is_file() else b""

    def _reload_if_rewound(self) -> None:
        """A resumed trainer rewound the mailbox: forget M and start again from the kept state."""
        mark = self._rewind_mark()
        if mark != self._rewind_seen:
            self._rewind_seen, self.M, self.bases, self.thetas, self.done = mark, {}, {}, {}, -1
            log(f"the trainer rewound the mailbox ({mark.decode(errors='replace')}): reloading")
            self._load_state()

    def _save_state(self, fire: int) -> None:
        mb.write_state(self.root, fire, {**self.M, **{f"basis.cut{l}": q for l, q in self.bases.items()}})

    # ---- serving ----------------------------------------------------------------------------
    def serve(self, parent_pid: int | None = None, poll: float = 0.1) -> None:
        """Answer requests until the trainer writes STOP (or, when started by it, the trainer dies).
        A STOP older than this process is a finished earlier run's, and is ignored."""
        stop, started = self.root / "STOP", time.time()
        while not (stop.exists() and stop.stat().st_mtime >= started):
            if parent_pid and not _alive(parent_pid):
                log(f"trainer (pid {parent_pid}) is gone: exiting")
                return
            self._reload_if_rewound()
            for req in mb.pending_requests(self.root, self.done):
                if self._rewind_mark() != self._rewind_seen:
                    break
                try:
                    self.fire(req)
                except mb.MailboxError as e:   # inputs missing or corrupt: skip this fire, keep serving
                    log(f"fire {req['fire']} skipped: {e}")
                    self.done = req["fire"]
            time.sleep(poll)
        log("STOP found: exiting")

    def fire(self, req: dict) -> None:
        t0 = time.perf_counter()
        f, s = req["fire"], req["weights_step"]
        fault_point("fire", f, who=f"anchor{os.environ.get('DS_TWOCIRCUIT_ANCHOR_START', '0')}")
        layouts = [mb.theta_shapes(self.root, s, i) for i in range(req["stages"])]
        theta = self._read_theta(s, layouts)
        if req.get("older_step") is not None:
            theta = forecast(theta, self._read_theta(req["older_step"], layouts), req["staleness"], req["every"])
        batch = Rollout(**mb.read_tensors(mb.batch_path(self.root, s), s))
        # the β step s trained with (the drift controller may have moved it)
        g = self.gradient(theta, batch, dataclasses.replace(self.coefs, kl_coef=req.get("kl_coef", self.coefs.kl_coef)))
        self.M = update_memory(self.M, g, self.tc.anchor.beta_m)
        self._save_state(f)
        self._publish(f, layouts)
        self.done = f
        how = f"θ({s})" if req.get("older_step") is None else f"θ̂ from θ({s}), θ({req['older_step']})"
        log(f"fire {f}: replayed {how} on {batch.ids_NT.shape[0]} sequences in {time.perf_counter() - t0:.2f} s")

    def _read_theta(self, step: int, layouts: list[dict]) -> dict[str, torch.Tensor]:
        """θ(step), rebuilt from its deltas against the steps read lately (the last 3 are kept)."""
        stages = [mb.read_theta(self.root, step, i, shapes, {s: th[i] for s, th in self.thetas.items()})
                  for i, shapes in enumerate(layouts)]
        self.thetas = {s: th for s, th in sorted({**self.thetas, step: stages}.items())[-3:]}
        return {n: t for stage in stages for n, t in stage.items()}

    @torch.no_grad()
    def _load(self, theta: dict[str, torch.Tensor]) -> None:
        missing = self.params.keys() - theta.keys()
        if missing:
            raise mb.MailboxError(f"shipped θ lacks {sorted(missing)[:3]}...")
        for n, q in self.params.items():
            q.copy_(theta[n])

    def gradient(self, theta: dict[str, torch.Tensor], r: Rollout, coefs: LossCoefs) -> dict[str, torch.Tensor]:
        """G_anc: the dense gradient of the trainer's GRPO loss (token mean over the batch) at θ; the
        lowrank bases are refreshed from the same forward."""
        self._load(theta)
        ref = passes.logprobs(self.p, r, self.base) if coefs.kl_coef > 0 else torch.zeros_like(r.resp_NT1)
        layers = self.cuts if self.tc.codec.name == "lowrank" else []
        with recording_cuts(self.p.pipe, layers) as acts:
            grads, _ = passes.dense_gradient(self.p, r, r.num_response_tokens, ref, coefs)
        self._refresh_bases(acts)
        return {n: grads[n] for n in self.params}

    def _refresh_bases(self, acts: dict) -> None:
        for layer, xs in acts.items():
            x = torch.cat(xs).double()
            x = x[x.abs().sum(-1) > 0]
            self.bases[layer] = top_basis(x, self.k) if layer not in self.bases else refresh_basis(x, self.bases[layer])

    def _publish(self, fire: int, layouts: list[dict]) -> None:
        """Write sign(M) per stage (and the bases) into a hidden directory, then rename it into place."""
        final = mb.sign_dir(self.root, fire)
        tmp = final.with_name(f".{final.name}.tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        for i, shapes in enumerate(layouts):
            flat = torch.cat([self.M[n].reshape(-1) for n in shapes])
            mb.write_sign(tmp / mb.sign_path(self.root, fire, i).name, fire, i, shapes, pack_signs(flat), flat.numel(),
                          zero_runs(flat))
        if self.bases:
            mb.write_tensors(tmp / "bases.safetensors", fire, {f"cut{l}": q for l, q in self.bases.items()})
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def log(msg: str) -> None:
    print(f"[anchor {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def main(argv=None) -> None:
    """`python launch/anchor.py --mailbox DIR [--ds-config FILE] [key=value ...]`."""
    p = argparse.ArgumentParser(description="the dense anchor process: serves a trainer's mailbox")
    p.add_argument("--mailbox", required=True, help="the run's anchor directory (anchor.mailbox)")
    p.add_argument("--ds-config", default=None, help="default: <mailbox>/config.json, written by the trainer")
    p.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)   # set by a managing trainer
    p.add_argument("overrides", nargs="*", help="dotted twocircuit keys")
    args = p.parse_args(argv)
    root = pathlib.Path(args.mailbox)
    cfg = args.ds_config or str(root / "config.json")
    if not args.ds_config and not pathlib.Path(cfg).is_file():
        log(f"waiting for the trainer to write {cfg}")
        while not pathlib.Path(cfg).is_file():   # started before the trainer: wait for its config
            time.sleep(0.5)
    from ..config import load_or_exit, load_recipe
    run = load_or_exit(load_recipe, cfg, args.overrides, not args.ds_config)   # the trainer's resolved config
    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(_free_port())})
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from ..model.weights import base_model_dir
    model_dir = base_model_dir(run.tc)
    init_distributed(run.tc.train.collective_timeout)
    log(f"serving {root} (pid {os.getpid()})")
    AnchorWorker(root, model_dir, run.tc, run.ds).serve(args.parent_pid)


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    main()
