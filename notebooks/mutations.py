"""The mutation table: each bug a test is for, injected by hand, and which tests fail on it.

For every mutation below (a file, a unique string in it and its replacement) the script checks
out COMMIT into a scratch git worktree, applies the mutation there, runs the named tests with
that worktree's package first on the path, and records whether they failed; the worktree is
removed after. Run it on the commit before a test was added or strengthened and on the one after
to show the test is what catches the bug:

    python notebooks/mutations.py --commit OLD --suite old [--only ID ...]
    python notebooks/mutations.py --commit NEW --suite new [--only ID ...]

Prints one line per mutation (id, PASS = the suite missed the bug, FAIL = it caught it, seconds) and
writes the table as JSON to --out. The tests of each suite are pytest node ids; `old` lists the
tests that existed before and were named for the bug, `new` the tests that are now meant to fail.
"""
import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]

# id: (what it breaks, file, old text, new text, {"old": [tests], "new": [tests]})
MUTATIONS = {
    "loss_sign": ("the pipeline's GRPO loss returned negated", "ds_twocircuit/pipeline/passes.py",
                  "return loss * self.scale", "return -loss * self.scale",
                  {"old": ["tests/test_loss.py", "tests/test_pipeline.py::test_one_stage_equals_eight_stages",
                           "tests/test_pipeline.py::test_micro_batch_split_does_not_change_the_loss",
                           "tests/test_codec_dist.py::test_compressed_pipeline_gradients_equal_single_process_autograd"],
                   "new": ["tests/test_pipeline.py::test_the_grpo_objective_as_the_pipeline_applies_it"]}),
    "adv_shift": ("advantages attached to the next row", "ds_twocircuit/pipeline/passes.py",
                  "r.adv_N[s], old_NT1[s]", "r.adv_N.roll(1)[s], old_NT1[s]",
                  {"old": ["tests/test_loss.py", "tests/test_pipeline.py::test_one_stage_equals_eight_stages",
                           "tests/test_pipeline.py::test_micro_batch_split_does_not_change_the_loss"],
                   "new": ["tests/test_pipeline.py::test_the_grpo_objective_as_the_pipeline_applies_it"]}),
    "loss_no_temperature": ("the update's loss ignores τ", "ds_twocircuit/pipeline/passes.py",
                            "token_logprobs(logits_BTV[:, :-1], targets, self.temperature)",
                            "token_logprobs(logits_BTV[:, :-1], targets, 1.0)",
                            {"old": ["tests/test_loss.py", "tests/test_pipeline.py::test_one_stage_equals_eight_stages"],
                             "new": ["tests/test_pipeline.py::test_the_grpo_objective_as_the_pipeline_applies_it"]}),
    "clip_not_applied": ("the true-norm clip reads the norm and scales nothing", "ds_twocircuit/pipeline/clip.py",
                         "p.grad.mul_(coef)", "p.grad.mul_(1.0)",
                         {"old": ["tests/test_pipeline.py::test_one_stage_equals_eight_stages"],
                          "new": ["tests/test_pipeline.py::test_the_grpo_objective_as_the_pipeline_applies_it",
                                  "tests/test_pipeline.py::test_eight_stages_take_grpo_steps_and_export"]}),
    "clip_own_stage": ("the clip's norm counts this stage only", "ds_twocircuit/pipeline/clip.py",
                       "dist.all_reduce(sq, group=self.group)", "pass",
                       {"old": ["tests/test_pipeline.py::test_one_stage_equals_eight_stages"],
                        "new": ["tests/test_pipeline.py::test_the_grpo_objective_as_the_pipeline_applies_it"]}),
}


def run(commit: str, suite: str, only: list[str], out: pathlib.Path) -> list[dict]:
    results = []
    subprocess.run(["git", "worktree", "prune"], cwd=ROOT, check=True)
    cache = os.environ.setdefault("DS_TWOCIRCUIT_TEST_CACHE", str(pathlib.Path(tempfile.gettempdir()) / "mutcache"))
    for mid, (what, path, old, new, tests) in MUTATIONS.items():
        if only and mid not in only:
            continue
        tree = pathlib.Path(tempfile.mkdtemp(prefix=f"mut-{mid}-"))
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), commit], cwd=ROOT, check=True,
                       capture_output=True)
        try:
            f = tree / path
            text = f.read_text()
            assert text.count(old) == 1, f"{mid}: '{old}' occurs {text.count(old)} times in {path} at {commit}"
            f.write_text(text.replace(old, new))
            t0 = time.time()
            p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests[suite]],
                               cwd=tree, env={**os.environ, "PYTHONPATH": str(tree), "DS_TWOCIRCUIT_TEST_CACHE": cache},
                               capture_output=True, text=True)
            # FAIL only where a test failed; a suite that could not run (collection, setup) is an error
            verdict = "PASS" if p.returncode == 0 else "FAIL" if p.returncode == 1 else f"ERROR rc={p.returncode}"
            tail = [l for l in p.stdout.splitlines() if l.startswith(("FAILED", "ERROR"))][:3]
            why = [l[:200] for l in p.stdout.splitlines() if l.startswith("E ")][:2] or p.stderr.splitlines()[-2:]
            results.append({"id": mid, "what": what, "suite": suite, "commit": commit, "verdict": verdict,
                            "tests": tests[suite], "failed": tail, "why": why, "seconds": round(time.time() - t0)})
            print(f"{mid:24s} {suite}: {verdict} ({round(time.time() - t0)} s) {' '.join(tail)} {' | '.join(why)}", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, capture_output=True)
    if out:
        prev = json.loads(out.read_text()) if out.is_file() else []
        keep = [r for r in prev if (r["id"], r["suite"]) not in {(x["id"], x["suite"]) for x in results}]
        out.write_text(json.dumps(keep + results, indent=1))
    return results


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--commit", required=True)
    ap.add_argument("--suite", choices=["old", "new"], required=True)
    ap.add_argument("--only", nargs="*", default=[])
    ap.add_argument("--out", type=pathlib.Path, default=ROOT / "notebooks" / "mutations.json")
    a = ap.parse_args()
    run(a.commit, a.suite, a.only, a.out)
