"""The mutation table: each bug a test is for, injected by hand, and which tests fail on it.

For every mutation below (a file, a unique string in it and its replacement) the script checks
out COMMIT into a scratch git worktree, applies the mutation there, runs the named tests with
that worktree's package first on the path, and records whether they failed; the worktree is
removed after. Run it on the commit before a test was added or strengthened and on the one after
to show the test is what catches the bug:

    python notebooks/mutations.py --commit OLD --suite old [--only ID ...] [--tests NODEID ...]
    python notebooks/mutations.py --commit NEW --suite new [--only ID ...] [--tests NODEID ...]
    python notebooks/mutations.py --table          # docs/testing.md's table from the JSON

Prints one line per mutation (id, PASS = the suite missed the bug, FAIL = it caught it, seconds) and
writes the results as JSON to --out. A mutation whose string no longer occurs exactly once is
printed as STALE, skipped, and makes the script exit non-zero at the end (the code moved on: update
the string, never drop the row quietly). The tests of each suite are pytest node ids (-x: the first
failure ends a suite); `old` lists the tests that existed before and were named for the bug, `new`
the tests that are now meant to fail. One heavy job at a time: about 6 minutes for the new suite
and 20 for the old on 2 cores.
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

OBJECTIVE = "tests/test_pipeline.py::test_the_grpo_objective_as_the_pipeline_applies_it"
EQUIVALENCE = ["tests/test_pipeline.py::test_one_stage_equals_eight_stages",
               "tests/test_pipeline.py::test_micro_batch_split_does_not_change_the_loss"]
ANCHOR_NEW = "tests/test_anchor_dist.py::test_memory_forecast_and_a_codec_on_one_cut"
GRADS = "tests/test_codec_dist.py::test_compressed_pipeline_gradients_equal_single_process_autograd"
DECODES = "tests/test_codec_dist.py::test_every_cut_decodes_what_was_sent"


def m(what, path, old, new, old_tests, new_tests, old_edit=None):
    """A mutation: `old` → `new` in `path` (`old_edit` = (path, old, new) instead on the commit before
    this change, where the code read otherwise); the tests each suite runs on it."""
    return {"what": what, "edits": {"new": (path, old, new), "old": old_edit or (path, old, new)},
            "tests": {"old": old_tests, "new": new_tests}}


MUTATIONS = {
    "loss_sign": m("the pipeline's GRPO loss returned negated", "ds_twocircuit/pipeline/passes.py",
                   "return loss * self.scale", "return -loss * self.scale",
                   ["tests/test_loss.py", *EQUIVALENCE,
                    "tests/test_codec_dist.py::test_compressed_pipeline_gradients_equal_single_process_autograd"],
                   [OBJECTIVE]),
    "adv_shift": m("advantages attached to the next row", "ds_twocircuit/pipeline/passes.py",
                   "r.adv_N[rows], old_NT1[rows, t]", "r.adv_N.roll(1)[rows], old_NT1[rows, t]",
                   ["tests/test_loss.py", *EQUIVALENCE],
                   [OBJECTIVE]),
    "loss_no_temperature": m("the update's loss ignores τ", "ds_twocircuit/pipeline/passes.py",
                             "out.weight_VD, targets, self.temperature)",
                             "out.weight_VD, targets, 1.0)",
                             ["tests/test_loss.py", *EQUIVALENCE], [OBJECTIVE]),
    "clip_not_applied": m("the true-norm clip reads the norm and scales nothing", "ds_twocircuit/pipeline/clip.py",
                          "p.grad.mul_(coef)", "p.grad.mul_(1.0)", EQUIVALENCE[:1],
                          [OBJECTIVE, "tests/test_pipeline.py::test_eight_stages_take_grpo_steps_and_export"]),
    "clip_own_stage": m("the clip's norm counts this stage's gradient only", "ds_twocircuit/pipeline/clip.py",
                        "comm.all_reduce_sum_(sq, self.group)", "pass", EQUIVALENCE[:1], [OBJECTIVE]),
    "memory_forgets": m("the anchor's M is the last fire's (1 − β)G alone", "ds_twocircuit/anchor/memory.py",
                        "beta * M[n] + (1 - beta) * g if n in M else (1 - beta) * g", "(1 - beta) * g",
                        ["tests/test_anchor_math.py", "tests/test_anchor_dist.py"],
                        ["tests/test_anchor_math.py::test_memory_over_two_fires_is_the_closed_form", ANCHOR_NEW],
                        old_edit=("ds_twocircuit/anchor/worker.py",
                                  "b * self.M[n] + (1 - b) * t if n in self.M else (1 - b) * t", "(1 - b) * t")),
    "memory_swapped": m("M ← (1 − β)M + βG", "ds_twocircuit/anchor/memory.py",
                        "beta * M[n] + (1 - beta) * g if n in M", "(1 - beta) * M[n] + beta * g if n in M",
                        ["tests/test_anchor_math.py", "tests/test_anchor_dist.py"],
                        ["tests/test_anchor_math.py::test_memory_over_two_fires_is_the_closed_form", ANCHOR_NEW],
                        old_edit=("ds_twocircuit/anchor/worker.py", "b * self.M[n] + (1 - b) * t if n in self.M",
                                  "(1 - b) * self.M[n] + b * t if n in self.M")),
    "forecast_ignored": m("the anchor replays θ(t − K), never θ̂", "ds_twocircuit/anchor/worker.py",
                          'if req.get("older_step") is not None:', "if False:",
                          ["tests/test_anchor_math.py", "tests/test_anchor_dist.py"], [ANCHOR_NEW]),
    "anchor_no_temperature": m("the anchor's replay at τ = 1", "ds_twocircuit/anchor/worker.py",
                               'one.codec.name = "dense"', 'one.codec.name = "dense"; one.grpo.temperature = 1.0',
                               ["tests/test_anchor_dist.py"], [ANCHOR_NEW]),
    "sign_adopted_late": m("every fire after the first adopted K steps after it is due", "ds_twocircuit/anchor/link.py",
                           "ready = [f for f in mb.published_fires(self.root) if f <= t]",
                           "ready = [f for f in mb.published_fires(self.root) if f <= t - self.a.staleness or f == 0]",
                           ["tests/test_anchor_dist.py", "tests/test_faults.py::test_two_replicas_equal_one_on_the_same_global_batch"],
                           ["tests/test_anchor_dist.py::test_the_staleness_contract_at_c_equal_k_equal_2"]),
    "dense_every_ignored": m("train.dense_every never runs a dense step", "ds_twocircuit/trainer.py",
                             "dense = bool(every) and (t + 1) % every == 0", "dense = False",
                             ["tests/test_codec_dist.py::test_prf_wire_ratio_and_same_masks_across_passes"], [ANCHOR_NEW]),
    "boundaries_ignored": m("codec.boundaries compresses every cut", "ds_twocircuit/codec/geometry.py",
                            'return cut_layers(layers_per_stage) if boundaries == "all" else list(boundaries)',
                            "return cut_layers(layers_per_stage)",
                            ["tests/test_codec.py", "tests/test_config.py"], [ANCHOR_NEW]),
    "shared_head_misplaced": m("the receiver decodes a shared prompt at the wrong positions",
                               "ds_twocircuit/codec/shared_prompts.py",
                               "pos_BT[::G, :P], sid_B[::G], layer, dtype)", "pos_BT[::G, :P] + 1, sid_B[::G], layer, dtype)",
                               ["tests/test_codec.py", "tests/test_savings.py"],
                               ["tests/test_codec.py::test_a_shared_prompt_crosses_once_and_its_gradient_sums_over_the_group"]),
    "ppo_epochs_ignored": m("grpo.ppo_epochs > 1 runs one epoch", "ds_twocircuit/actor.py",
                            "for _ in range(ppo_epochs):", "for _ in range(1):",
                            ["tests/test_pipeline.py::test_several_ppo_mini_batches_use_pipeline_old_logprobs"],
                            ["tests/test_pipeline.py::test_several_ppo_mini_batches_use_pipeline_old_logprobs"]),
    "prf_indices_sent": m("PRF sends each token's kept indices (int16) beside its values", "ds_twocircuit/codec/boundary.py",
                          "return (self.encode(x_BTD, pos_BT, sid_B, layer),)",
                          "return (self.encode(x_BTD, pos_BT, sid_B, layer), *((prf.kept_for(self.seed, layer, self._step, "
                          "sid_B, pos_BT, self.d, self.k).to(torch.int16),) if self.name == 'prf' and self.active(layer) "
                          "else ()))",
                          ["tests/test_codec_dist.py::test_prf_wire_ratio_and_same_masks_across_passes"],
                          ["tests/test_codec_dist.py::test_prf_wire_ratio_and_same_masks_across_passes"]),
    "checkpoint_off": m("activation checkpointing silently off: the checkpoint function runs the layers plainly",
                        "ds_twocircuit/model/pipe.py", 'checkpointable_layers=["Decoder"], **kw)',
                        'checkpointable_layers=["Decoder"], activation_checkpoint_func=lambda f, *a: f(*a), **kw)',
                        ["tests/test_codec_dist.py::test_activation_checkpointing_recomputes_the_same_codes"],
                        ["tests/test_codec_dist.py::test_activation_checkpointing_recomputes_the_same_codes"]),
    # each end of a cut against the other: the receiver keyed as its sender was, buffers in the sent dtype
    "recv_buffers_any_dtype": m("DeepSpeed's receive-buffer pool hands out a larger buffer of another dtype as is",
                                "ds_twocircuit/pipeline/recv_buffers.py",
                                "    engine._allocate_or_extend_buffers = types.MethodType(_allocate_or_extend_buffers, engine)",
                                "    pass", [GRADS], [DECODES]),
    "receiver_next_position": m("the receiver keys each token at position + 1", "ds_twocircuit/model/pipe.py",
                                "self.codec.wire_in(tuple(wire), pos_BT, sid_B, layer, dtype))",
                                "self.codec.wire_in(tuple(wire), pos_BT + 1, sid_B, layer, dtype))",
                                [GRADS, "tests/test_device.py"], [DECODES]),
    "receiver_own_layer": m("the receiver keys the cut with its own layer index, not the sender's",
                            "ds_twocircuit/model/pipe.py",
                            "dtype, layer = next(self.layer.parameters()).dtype, self.layer_idx - 1",
                            "dtype, layer = next(self.layer.parameters()).dtype, self.layer_idx",
                            [GRADS, "tests/test_device.py"], [DECODES]),
    "key_step_offset": m("every cut keyed one step ahead of the step it runs in", "ds_twocircuit/codec/boundary.py",
                         "prev, self._step = self._step, step", "prev, self._step = self._step, step + 1",
                         [GRADS, "tests/test_device.py"], [DECODES]),
    "rotation_not_inverted": m("the rotated decoder applies the signs but not the inverse Hadamard transform",
                               "ds_twocircuit/codec/rotated.py",
                               "    return unrotate(z, signs(keys_N, budget.d)).to(dtype)",
                               "    return (z * signs(keys_N, budget.d)).to(dtype)",
                               [GRADS], ["tests/test_rotated.py::test_lossless_limit_and_zero_tokens"]),
    "signs_word_offset": m("the rotation's sign bits drop their word offset ⌊i/32⌋ (every 32 channels share signs)",
                           "ds_twocircuit/codec/rotated.py",
                           "[:, None] ^ torch.arange((d + 31) // 32, device=keys_N.device))",
                           "[:, None] ^ torch.zeros((d + 31) // 32, dtype=torch.long, device=keys_N.device))",
                           [GRADS], ["tests/test_rotated.py::test_golden_vectors"]),
}


def run(commit: str, suite: str, only: list[str], out: pathlib.Path, tests_override: list[str] = ()) -> list[dict]:
    results, stale = [], []
    subprocess.run(["git", "worktree", "prune"], cwd=ROOT, check=True)
    cache = os.environ.setdefault("DS_TWOCIRCUIT_TEST_CACHE", str(pathlib.Path(tempfile.gettempdir()) / "mutcache"))
    for mid, mut in MUTATIONS.items():
        what, tests = mut["what"], mut["tests"]
        path, old, new = mut["edits"][suite]
        if only and mid not in only:
            continue
        tree = pathlib.Path(tempfile.mkdtemp(prefix=f"mut-{mid}-"))
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), commit], cwd=ROOT, check=True,
                       capture_output=True)
        try:
            f = tree / path
            text = f.read_text() if f.is_file() else ""
            if text.count(old) != 1:   # the code moved on: say so loudly and go on with the others
                print(f"{mid:24s} {suite}: STALE: '{old}' occurs {text.count(old)} times in {path} at {commit}; "
                      "update the mutation", flush=True)
                stale.append(mid)
                continue
            f.write_text(text.replace(old, new))
            t0 = time.time()
            chosen = list(tests_override) or tests[suite]
            p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *chosen],
                               cwd=tree, env={**os.environ, "PYTHONPATH": str(tree), "DS_TWOCIRCUIT_TEST_CACHE": cache},
                               capture_output=True, text=True)
            # FAIL only where a test failed; a suite that could not run (collection, fixture setup, a
            # launch that never started) is an error, not a catch. Run the unmutated suite once first
            # (plain pytest) so that a failure here is the mutation's.
            summary = (p.stdout.strip().splitlines() or [""])[-1]
            verdict = ("PASS" if p.returncode == 0 else "FAIL" if p.returncode == 1 and " error" not in summary
                       else f"ERROR rc={p.returncode}")
            tail = [l for l in p.stdout.splitlines() if l.startswith(("FAILED", "ERROR"))][:3]
            why = [l[:200] for l in p.stdout.splitlines() if l.startswith("E ")][:2] or p.stderr.splitlines()[-2:]
            sha = subprocess.run(["git", "rev-parse", commit], cwd=ROOT, capture_output=True, text=True).stdout.strip()
            results.append({"id": mid, "what": what, "suite": suite, "commit": sha, "verdict": verdict,
                            "tests": chosen, "failed": tail, "why": why, "seconds": round(time.time() - t0)})
            print(f"{mid:24s} {suite}: {verdict} ({round(time.time() - t0)} s) {' '.join(tail)} {' | '.join(why)}", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, capture_output=True)
    if out:
        prev = json.loads(out.read_text()) if out.is_file() else []
        key = lambda r: (r["id"], r["suite"], tuple(r["tests"]))
        keep = [r for r in prev if key(r) not in {key(x) for x in results}]
        out.write_text(json.dumps(keep + results, indent=1))
    if stale:
        sys.exit(f"{len(stale)} mutation(s) no longer apply at {commit}: {', '.join(stale)}")
    return results


def table(results: list[dict]) -> str:
    """The markdown table of docs/testing.md: one row per mutation, what the old and the new suite did."""
    by = {}
    for r in results:
        by.setdefault(r["id"], {}).setdefault(r["suite"], []).append(r)
    out = ["| mutation | what it breaks | before this change | now |", "|---|---|---|---|"]
    cell = lambda rs: "; ".join(f"{r['verdict'].lower().replace('pass', 'passed').replace('fail', 'caught')} "
                                f"({', '.join(t.split('::')[-1].replace('tests/', '') for t in r['tests'])})"
                                for r in rs) if rs else "—"
    for mid, mut in MUTATIONS.items():
        if mid in by:
            out.append(f"| `{mid}` | {mut['what']} | {cell(by[mid].get('old'))} | {cell(by[mid].get('new'))} |")
    return "\n".join(out)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--commit")
    ap.add_argument("--suite", choices=["old", "new"])
    ap.add_argument("--only", nargs="*", default=[])
    ap.add_argument("--tests", nargs="*", default=[], help="run these tests instead of the suite's")
    ap.add_argument("--table", action="store_true", help="print --out's results as docs/testing.md's table")
    ap.add_argument("--out", type=pathlib.Path, default=ROOT / "notebooks" / "mutations.json")
    a = ap.parse_args()
    if a.table:
        print(table(json.loads(a.out.read_text())))
    else:
        run(a.commit, a.suite, a.only, a.out, a.tests)
