"""Entry point: `deepspeed [--num_gpus N | --hostfile H] launch/train.py --ds-config FILE
[--run-dir DIR] [--resume] [key=value ...]`; `python launch/train.py --help-config` lists our keys.

Parse and validate the whole config first (no process group yet, so a mistake costs seconds and
prints one line), make sure the base model exists (the embedded one is built once and cached),
then start the process group, build the pipeline engine and train.
"""
import argparse
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
os.environ.setdefault("OMP_NUM_THREADS", "1")   # 8 ranks on a few cores: one thread each (see notes)

from ds_twocircuit.run.checkpoint import verify_latest  # noqa: E402
from ds_twocircuit.config import check_resume, describe, load_config, load_or_exit  # noqa: E402  (light: no torch)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ds-config", help="DeepSpeed JSON with a 'twocircuit' block")
    p.add_argument("--help-config", action="store_true", help="list every twocircuit key with its default and meaning")
    p.add_argument("--run-dir", default=None, help="default: runs/<config name>")
    p.add_argument("--resume", action="store_true", help="continue from the run dir's latest checkpoint")
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
    run = load_or_exit(load_config, args.ds_config, args.overrides, report=int(os.environ.get("RANK", "0")) == 0)
    run_dir = pathlib.Path(args.run_dir or f"runs/{pathlib.Path(args.ds_config).stem}")
    if args.resume:
        load_or_exit(check_resume, run, run_dir, report=int(os.environ.get("RANK", "0")) == 0)
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:   # each node checks the files it will read
            print(f"[resume] {load_or_exit(verify_latest, run_dir / 'checkpoints')}", flush=True)

    import torch
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    from ds_twocircuit.pipeline.engine import init_distributed
    from ds_twocircuit.model.weights import base_model_dir
    from ds_twocircuit.trainer import Trainer, TrainingStopped

    model_dir = base_model_dir(run.tc)
    init_distributed()
    try:
        Trainer(run, run_dir, model_dir, resume=args.resume).run()
    except TrainingStopped as e:   # every rank stops at the same step; one line says why
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"{e.label}: {e}", file=sys.stderr, flush=True)
        exit_now(1)
    exit_now(0)


def exit_now(code: int) -> None:
    """End the rank without tearing down its process groups: at interpreter exit each gloo group's
    destructor waits on its event loop for every TCP pair, ~7 s per launch here, after the run is
    over. Everything of ours is closed and flushed by then (Trainer.close)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
