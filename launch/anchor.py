"""Entry point of the dense anchor process: `python launch/anchor.py --mailbox DIR [--ds-config FILE] [key=value ...]`.

The trainer starts it itself for the embedded default. With `anchor.external=true` the user runs it,
on any host that sees the run's mailbox directory (shared filesystem, or any file transport that
syncs it both ways); it needs no GPU peers and never joins the trainer's process group.
"""
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
os.environ.setdefault("OMP_NUM_THREADS", "1")

from ds_twocircuit.anchor.worker import main  # noqa: E402

if __name__ == "__main__":
    main()
