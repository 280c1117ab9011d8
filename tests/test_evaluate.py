"""launch/evaluate.py, the harness: benchmarks in one call, greedy mean@1 and avg@k, a table and JSON."""
import json
import subprocess
import sys

import pytest

from conftest import ROOT, TINY


def evaluate(*args, timeout=300):
    return subprocess.run([sys.executable, "launch/evaluate.py", *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def test_the_embedded_task(tiny_model, tmp_path):
    out = tmp_path / "eval.json"
    p = evaluate("--model", tiny_model, "--ds-config", TINY, "--k", 3, "--backend", "hf", "--out", out,
                 "data.eval_size=32")
    assert p.returncode == 0, p.stderr[-3000:]
    (r,) = json.loads(out.read_text())["results"]
    assert r["bench"] == "held_out" and r["n"] == 32 and r["k"] == 3
    assert 0 < r["mean@1"] <= 1 and 0 <= r["avg@k"] <= r["pass@k"] <= 1 and r["spread"] >= 0
    assert f"| held_out | 32 | {r['mean@1']:.3f} | {r['avg@k']:.3f} | ±{r['spread']:.3f} |" in p.stdout


def test_several_benchmarks_in_one_call_on_the_user_fixtures(fixtures, tmp_path):
    """The fixture model with its chat template, the test split as jsonl (k = 3 from the spec) and as
    parquet (k = 2): both files hold the same rows, so greedy mean@1 is equal; a bad --bench fails
    before any model loads."""
    out, test = tmp_path / "eval.json", fixtures["test"]
    p = evaluate("--model", fixtures["model"], "--ds-config", TINY, "--backend", "hf", "--k", 2, "--out", out,
                 "--bench", f"jsonl={test}:3", "--bench", f"parquet={test.with_suffix('.parquet')}",
                 f"model.path={fixtures['model']}", "data.chat_template=true", "grpo.max_new_tokens=8")
    assert p.returncode == 0, p.stderr[-3000:]
    a, b = json.loads(out.read_text())["results"]
    assert (a["bench"], a["n"], a["k"], b["bench"], b["n"], b["k"]) == ("jsonl", 80, 3, "parquet", 80, 2)
    assert a["mean@1"] == b["mean@1"]
    bad = evaluate("--model", fixtures["model"], "--ds-config", TINY, "--bench", "nothing-here", timeout=60)
    assert bad.returncode != 0 and "--bench nothing-here: expected held_out or NAME=SOURCE[:K]" in bad.stderr


def test_a_run_is_evaluated_from_its_own_config(eight, tiny_model, tmp_path):
    """`--run RUN_DIR` reads the run's config.yaml (model, data, split, lengths) and its model/: the
    held-out greedy accuracy is the one the run logged at its last step with the sampler's final
    weights (the export is those weights: test_user_path); with `--model` the base model, it is the
    one the run logged at step 0. Its config.yaml as --ds-config is refused with the way to read it."""
    out = tmp_path / "eval.json"
    p = evaluate("--run", eight, "--k", 0, "--backend", "hf", "--out", out)
    assert p.returncode == 0, p.stderr[-3000:]
    (r,) = json.loads(out.read_text())["results"]
    last = json.loads((eight / "eval.jsonl").read_text().splitlines()[-1])
    assert r["n"] == last["n"] and r["mean@1"] == pytest.approx(last["acc"], abs=1e-12)
    base = evaluate("--run", eight, "--model", tiny_model, "--k", 0, "--backend", "hf", "--out", tmp_path / "base.json")
    assert base.returncode == 0, base.stderr[-3000:]
    first = json.loads((eight / "eval.jsonl").read_text().splitlines()[0])
    assert json.loads((tmp_path / "base.json").read_text())["results"][0]["mean@1"] == pytest.approx(first["acc"], abs=1e-12)
    bad = evaluate("--model", eight / "model", "--ds-config", eight / "config.yaml", timeout=60)
    assert bad.returncode == 2 and "read it with --run RUN_DIR" in bad.stderr, bad.stderr
