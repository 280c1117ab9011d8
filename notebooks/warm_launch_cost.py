"""What a test launch costs through DeepSpeed's launcher and through the warm launcher, side by side.

    python notebooks/warm_launch_cost.py [--pairs 3] [--steps 1]

Alternates the two ways of starting the same run (the tests' tiny config, 8 ranks, `--steps` GRPO
steps) `--pairs` times, after one warm-up launch that starts the warm server and builds the tests'
model into a private cache, and prints each launch's wall time and the median ratio.
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--steps", type=int, default=1)
    a = p.parse_args()
    os.environ.setdefault("DS_TWOCIRCUIT_CACHE", tempfile.mkdtemp(prefix="cache"))
    import conftest   # the tests' launch_cmd and warm server
    out = pathlib.Path(tempfile.mkdtemp(prefix="warmcost"))

    def timed(real: bool, i: int) -> float:
        cmd, env = conftest.launch_cmd(8, out / f"{'real' if real else 'warm'}{i}", f"train.steps={a.steps}",
                                       "train.eval_every=100", "train.save_every=0", real=real)
        t0 = time.perf_counter()
        subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True)
        return time.perf_counter() - t0

    print(f"warm-up (server start, model build): {timed(False, -1):.1f} s", flush=True)
    real, warm = [], []
    for i in range(a.pairs):
        real.append(timed(True, i))
        warm.append(timed(False, i))
        print(f"pair {i}: deepspeed {real[-1]:.1f} s, warm {warm[-1]:.1f} s", flush=True)
    print(f"median: deepspeed {statistics.median(real):.1f} s, warm {statistics.median(warm):.1f} s, "
          f"ratio {statistics.median(real) / statistics.median(warm):.2f}")


if __name__ == "__main__":
    main()
