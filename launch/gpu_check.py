"""The GPU checks in one command, one line per check: `python launch/gpu_check.py [pytest args]`.

Run on a machine with 1–8 NVIDIA GPUs after installing the CUDA build of torch and the vLLM
extra (`pip install torch -e '.[test,vllm]'`). It runs tests/test_gpu.py (the pipeline's logits
over NCCL against HF, vLLM's CUDA engine taking weights in place, a bf16 launch, and the whole
product: bf16 + ZeRO-1, PRF, the anchor process, vLLM, every collective recorded, a kill and a
resume, every codec on CUDA, the HF sampler and the reference on CUDA, and on 4 GPUs or more compressed
trimmed cuts over NCCL against gloo) and prints, per check, PASS / FAIL / SKIP, its seconds and,
for a failure or a skip, its first line. Multi-stage checks print SKIP on fewer GPUs than they need,
and a last line says none of them ran. 180 s on one H100 (2026-12-06; 8 minutes at most); exit status 1 if any
check failed.
`GPU_CHECK_LOG=FILE` keeps pytest's whole output there.
"""
import os
import pathlib
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

ROOT = pathlib.Path(__file__).resolve().parents[1]


def main(argv: list[str]) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        report = pathlib.Path(tmp) / "gpu.xml"
        log = open(os.environ["GPU_CHECK_LOG"], "w") if os.environ.get("GPU_CHECK_LOG") else subprocess.DEVNULL
        subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rA", "-p", "no:cacheprovider",
                        f"--junitxml={report}", "tests/test_gpu.py", *argv], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        if not report.is_file():
            print("FAIL  pytest did not run (see `python -m pytest -m gpu tests/test_gpu.py`)")
            return 1
        failed, short = 0, []
        for case in ET.parse(report).getroot().iter("testcase"):
            bad = case.find("failure") if case.find("failure") is not None else case.find("error")
            skip = case.find("skipped")
            verdict = "FAIL" if bad is not None else "SKIP" if skip is not None else "PASS"
            why = (bad if bad is not None else skip).get("message", "") if verdict != "PASS" else ""
            print(f"{verdict}  {case.get('name')}  {float(case.get('time', 0)):.0f} s  {why.splitlines()[0][:160] if why else ''}")
            failed += verdict == "FAIL"
            if verdict == "SKIP" and "multi-stage" in why:
                short.append(case.get("name"))
        if short:   # a PASS above is then a one-stage result: no compressed cut has crossed NCCL
            print(f"NOT RUN: {len(short)} multi-stage check(s) on this machine's GPUs ({', '.join(short)}): the checks "
                  "that passed say nothing of a stage boundary over NCCL; run them on 4 GPUs or more")
        return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
