"""The managed anchor process: rank 0's child, restarted when it dies.

The trainer starts `python -m ds_twocircuit.anchor.worker` on the run's mailbox with its own log
(`anchor.log`), outside the trainer's torch.distributed world (none of the launcher's rank
variables reach it). A dead anchor costs the run nothing but fresh signs: the trainer holds the last
sign and restarts the process (it resumes M from its state file) at most `anchor.max_restarts` times.
"""
import os
import pathlib
import subprocess
import sys

import psutil

_DIST_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT", "CROSS_RANK",
             "CROSS_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE", "TORCHELASTIC_RUN_ID")


class AnchorProcess:
    def __init__(self, root: pathlib.Path, max_restarts: int, device: int = -1):
        """`device`: the node's GPU the process may see (CUDA_VISIBLE_DEVICES); −1: rank 0's."""
        self.root, self.max_restarts, self.device = root, max_restarts, device
        self.proc, self.restarts, self.gave_up = None, 0, False

    def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if k not in _DIST_ENV}
        env["OMP_NUM_THREADS"] = "1"
        if self.device >= 0:
            env["CUDA_VISIBLE_DEVICES"] = str(self.device)
        env["DS_TWOCIRCUIT_ANCHOR_START"] = str(self.restarts)   # which start this is (run/faults.py)
        with open(self.root / "anchor.log", "ab") as log:   # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen([sys.executable, "-m", "ds_twocircuit.anchor.worker", "--mailbox",
                                          str(self.root), "--parent-pid", str(os.getpid())], env=env, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        (self.root / "anchor.pid").write_text(str(self.proc.pid))

    def restart_if_exited(self, held: int) -> bool:
        """Restart the process if it has exited, within the restart budget; → whether it had exited
        (or was given up), i.e. whether a fire can no longer be waited for from it. `held` (the fire
        whose sign the trainer holds) is for the message."""
        if self.gave_up:
            return True
        if self.proc.poll() is None:
            return False
        print(f"[anchor] the anchor process exited with {self.proc.returncode}; holding sign of fire {held}",
              file=sys.stderr, flush=True)
        if self.restarts < self.max_restarts:
            self.restarts += 1
            self.start()
        else:
            print(f"[anchor] {self.restarts} restarts used (anchor.max_restarts): training on without new signs",
                  file=sys.stderr, flush=True)
            self.gave_up = True
        return True

    def stop_stale(self) -> None:
        """Before a resume rewinds the mailbox: end the anchor a crashed trainer started, if it still
        runs (it exits by itself when it sees its trainer gone, but may be inside a fire)."""
        try:
            pid = int((self.root / "anchor.pid").read_text())
            proc = psutil.Process(pid)
            if "ds_twocircuit.anchor.worker" not in " ".join(proc.cmdline()):
                return
            proc.terminate()
            proc.wait(timeout=10)
        except psutil.TimeoutExpired:
            proc.kill()
        except (OSError, ValueError, psutil.Error):
            return

    def wait(self, timeout: float = 30) -> None:
        """After the trainer wrote STOP: let the process exit, or kill it."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
