"""Entry point: `deepspeed [--num_gpus N | --hostfile H] launch/train.py --ds-config FILE
[--run-dir DIR] [--resume | --overwrite] [key=value ...] [ds.KEY=value ...]`; `python launch/train.py
--help-config` lists our keys; `ds.`-prefixed overrides set DeepSpeed's own (`ds.optimizer.params.lr=1e-5`).

Parse and validate the whole config and its inputs first (no process group yet, so a mistake costs
seconds and prints one line), refuse to write over an earlier run in the run dir (unless --resume or
--overwrite), check that the installed DeepSpeed is the release the pipeline was tested with (one
line too), on CUDA refuse a placement whose memory plan leaves a GPU under 10 % free (one line
naming the key to move: config/memory.py), make sure the base model exists (the embedded one is
built once and cached), then start the process group, build the pipeline engine and train. A collective that waits longer than
train.collective_timeout stops the run with one line; so does Ctrl-C, with the command to continue.
"""
import argparse
import functools
import os
import pathlib
import re
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
os.environ.setdefault("OMP_NUM_THREADS", "1")   # 8 ranks on a few cores: one thread each (see notes)
RANK = int(os.environ.get("RANK", "0"))

from ds_twocircuit.run import console  # noqa: E402
console.quiet(RANK)                    # before the libraries that warn at import

from ds_twocircuit.run import interrupt, run_dir as run_dirs  # noqa: E402
from ds_twocircuit.run.checkpoint import verify_latest  # noqa: E402
from ds_twocircuit.config import (REPORT_WAIT_S, check_resume, describe, load_config,  # noqa: E402  (light: no torch)
                                   load_or_exit)


class QuietParser(argparse.ArgumentParser):
    """argparse whose usage errors only rank 0 prints (the launcher ends the others)."""
    def error(self, message):
        if RANK == 0:
            super().error(message)
        time.sleep(REPORT_WAIT_S)
        sys.exit(2)


def parse_args(argv=None):
    p = QuietParser(description=__doc__.splitlines()[0])
    p.add_argument("--ds-config", help="DeepSpeed JSON with a 'twocircuit' block")
    p.add_argument("--help-config", action="store_true", help="list every twocircuit key with its default and meaning")
    p.add_argument("--run-dir", default=None, help="default: runs/<config name>")
    p.add_argument("--resume", action="store_true", help="continue from the run dir's latest checkpoint")
    p.add_argument("--overwrite", action="store_true", help="delete the run dir's earlier run first (without this "
                   "or --resume a run dir that holds a run is refused)")
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # set by the launcher
    p.add_argument("overrides", nargs="*", help="dotted twocircuit keys, e.g. train.steps=50")
    args = p.parse_intermixed_args(argv)   # key=value overrides may come before or after the options
    if not args.help_config and not args.ds_config:
        p.error("the following arguments are required: --ds-config")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.help_config:
        print("The 'twocircuit' block of a DeepSpeed JSON; override any key on the command line as key=value.\n")
        print(describe())
        return
    rank0 = RANK == 0
    # each node's first rank reports what it finds (its files may differ from another node's); one
    # node: one line. Only rank 0 reads the data, so only it checks the data files.
    local0 = int(os.environ.get("LOCAL_RANK", "0")) == 0
    run = load_or_exit(functools.partial(load_config, read_data=rank0), args.ds_config, args.overrides, report=local0)
    run_dir = pathlib.Path(args.run_dir or f"runs/{pathlib.Path(args.ds_config).stem}")
    load_or_exit(run_dirs.check_run_dir, run_dir, args.resume, args.overwrite, report=local0)
    if args.resume:
        load_or_exit(check_resume, run, run_dir, report=local0)
        if local0:   # each node checks the files it will read
            print(f"[resume] {load_or_exit(verify_latest, run_dir / 'checkpoints')}", flush=True)
    require_tested_deepspeed(report=rank0)
    gpu_gib = cuda_gib()
    if gpu_gib:   # every rank plans the same placement; a crowded GPU stops the launch here, in one line
        from ds_twocircuit.config.memory import check_placement
        load_or_exit(check_placement, run, gpu_gib, dict(os.environ), report=local0)
    if args.overwrite and local0:   # before the rendezvous: no rank writes yet
        load_or_exit(run_dirs.clear, run_dir, report=True)
    interrupt.install(run_dir, sys.argv, report=rank0)

    import torch
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    from ds_twocircuit.pipeline import comm
    from ds_twocircuit.pipeline.engine import init_distributed
    from ds_twocircuit.model.weights import base_model_dir
    from ds_twocircuit.run import provenance
    from ds_twocircuit.trainer import Trainer, TrainingStopped

    model_dir = base_model_dir(run.tc)
    start = load_or_exit(provenance.start_of, model_dir, report=rank0) if rank0 else None   # a corrupt start stops here
    timeout_s = run.tc.train.collective_timeout
    init_distributed(timeout_s)
    try:
        Trainer(run, run_dir, model_dir, resume=args.resume, start=start).run()
    except TrainingStopped as e:   # every rank stops at the same step; one line says why
        if rank0:
            print(f"{e.label}: {e}", file=sys.stderr, flush=True)
        comm.barrier()   # the launcher ends every rank at the first exit: rank 0's last row and line first
        exit_now(1)
    except RuntimeError as e:      # the ranks that waited time out together: the first of them says so
        reason = collective_timeout(e)
        if reason is None:
            raise
        if first_to_report("ds_twocircuit/collective_timeout"):
            print(f"collective timeout: rank {os.environ.get('RANK', '0')} waited more than train.collective_timeout="
                  f"{timeout_s:g}s for the others (one of them is stuck or slower than that: raise the key if its "
                  f"work takes that long; {reason})", file=sys.stderr, flush=True)
            time.sleep(2)   # this exit ends the launch (and the store): let the others that timed out count first
        else:
            time.sleep(REPORT_WAIT_S)   # as load_or_exit's silent ranks: the launcher ends this one
        exit_now(1)
    exit_now(0)


def require_tested_deepspeed(report: bool) -> None:
    """Import the pipeline package, which asserts the DeepSpeed release it drives: another one stops the
    launch with one line (on the reporting rank; the others wait for the launcher, as load_or_exit's
    do) and exit status 2, before any process group starts."""
    try:
        import ds_twocircuit.pipeline  # noqa: F401
    except ImportError as e:
        if getattr(e, "label", None) != "deepspeed version error":
            raise
        if report:
            print(f"{e.label}: {e}", file=sys.stderr, flush=True)
        else:
            time.sleep(REPORT_WAIT_S)
        sys.exit(2)


def cuda_gib() -> float | None:
    """One GPU's memory in GiB where the run trains on CUDA (DeepSpeed's accelerator), else None."""
    from deepspeed.accelerator import get_accelerator
    if get_accelerator().device_name() != "cuda":
        return None
    import torch
    return torch.cuda.get_device_properties(0).total_memory / 2 ** 30


def first_to_report(key: str) -> bool:
    """Whether this rank is the first of the launch to report `key`: a counter in the launch's
    rendezvous store (MASTER_ADDR:MASTER_PORT, served by rank 0's process even while its Python is
    busy). True where the store does not answer, so that some rank always reports."""
    import datetime

    import torch.distributed as dist
    try:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=datetime.timedelta(seconds=10))
        return store.add(key, 1) == 1
    except Exception:   # noqa: BLE001  (no store: report rather than stay silent)
        return True


# how a timed-out collective's error reads: gloo's "Timed out waiting 20000ms for recv operation to
# complete" (or, on a later operation over the same pair, "Application timeout caused pair closure"),
# the store's "wait timeout after ..."/"Timed out after ...", NCCL's "Watchdog caught collective
# operation timeout" when the watchdog raises instead of aborting the process
_TIMEOUT = re.compile(r"timed out (waiting|after)|timeout caused pair closure|operation timeout|wait timeout", re.I)


def collective_timeout(e: BaseException) -> str | None:
    """The line of a timed-out collective's error in e's chain that says so (its source location
    dropped), or None for any other error."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        line = next((l for l in str(e).splitlines() if _TIMEOUT.search(l)), None)
        if isinstance(e, RuntimeError) and line:
            return re.sub(r"^\s*\[[^\]]*\]\s*", "", line).strip()
        e = e.__cause__ or e.__context__
    return None


def exit_now(code: int) -> None:
    """End the rank without tearing down its process groups: at interpreter exit each gloo group's
    destructor waits on its event loop for every TCP pair, ~7 s per launch here, after the run is
    over. Everything of ours is closed and flushed by then (Trainer.close)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
