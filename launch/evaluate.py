"""Evaluate an HF checkpoint on several benchmarks: greedy mean@1 and avg@k at a temperature.

    python launch/evaluate.py --run runs/prf95                 # a run: its config and its model/
    python launch/evaluate.py --model DIR [--ds-config ds_configs/prf95.json]
        [--bench held_out] [--bench math500=HuggingFaceH4/MATH-500] [--bench aime=aime.jsonl:16]
        [--k 4] [--temperature 0.7] [--backend auto|hf|vllm] [--codec-budgets 0.05,0.25]
        [--out eval.json] [key=value ...]

`--run RUN_DIR` reads the run's resolved config (model, data, split, template, lengths) from its
config.yaml and evaluates its exported `model/`; `--model` and key=value overrides still apply.
A benchmark is `held_out` (the recipe's own held-out set: the embedded task's, or
`data.eval_dataset`) or NAME=SOURCE[:K], SOURCE a local .jsonl/.parquet file or a hub data set in
the local HF cache with `problem` and `answer` (or MATH's `solution`) columns, scored by
math-verify; K overrides `--k` for that set (published results: 16 or 32 on competition sets). Prompts
follow the recipe (`data.chat_template`, `data.system_prompt`, `data.max_prompt_len`), responses
`grpo.max_new_tokens`. Sampling runs on vLLM when it is installed (`--backend auto`), else HF.
`--codec-budgets` also reports the held-out set's greedy accuracy generated through the boundary
codec at those keep ratios (PRF, and a static SVD basis of the checkpoint's own activations; HF
backend). Prints a markdown table and writes it as JSON.
"""
import argparse
import importlib.util
import json
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", default=None, help="a run directory: its config.yaml and its model/ export")
    p.add_argument("--model", default=None, help="HF checkpoint directory (a run's model/ export) or hub name")
    p.add_argument("--ds-config", default=None, help="recipe for prompts, lengths and the cuts (without --run: "
                   "ds_configs/prf95.json)")
    p.add_argument("--bench", action="append", default=None, help="held_out, or NAME=SOURCE[:K] (repeatable)")
    p.add_argument("--k", type=int, default=4, help="samples per problem for avg@k (0: greedy only)")
    p.add_argument("--temperature", type=float, default=0.7, help="sampling temperature of avg@k")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", choices=["auto", "hf", "vllm"], default="auto")
    p.add_argument("--codec-budgets", default="", help="comma-separated keep ratios for the codec check")
    p.add_argument("--calibration", type=int, default=256, help="training rows for the static SVD bases")
    p.add_argument("--out", default=None, help="JSON output (default: <model>/../eval.json)")
    p.add_argument("overrides", nargs="*", help="dotted twocircuit keys, e.g. data.eval_size=256")
    args = p.parse_intermixed_args(argv)
    args.bench = args.bench or ["held_out"]
    if args.run and args.ds_config:
        p.error("--run reads the run's own config: leave out --ds-config (override keys as key=value)")
    if not args.run and not args.model:
        p.error("give --run RUN_DIR, or --model (with --ds-config)")
    args.exported = not args.model       # --run's own model/, which must exist
    args.model = args.model or str(pathlib.Path(args.run) / "model")
    return args


def benchmark_specs(specs: list[str], k: int) -> list[tuple[str, str, int]]:
    """`held_out` | NAME=SOURCE[:K] → (name, source, k); a bad one exits naming it."""
    out = []
    for s in specs:
        if s == "held_out":
            out.append(("held_out", "", k))
            continue
        name, eq, source = s.partition("=")
        head, colon, tail = source.rpartition(":")
        if colon and tail.isdigit():
            source, kk = head, int(tail)
        else:
            kk = k
        if not eq or not name or not source:
            sys.exit(f"--bench {s}: expected held_out or NAME=SOURCE[:K]")
        out.append((name, source, kk))
    return out


def build_sampler(args, tc):
    backend = args.backend
    if backend == "auto":
        backend = "vllm" if importlib.util.find_spec("vllm") else "hf"
    if backend == "vllm":
        from ds_twocircuit.sampler.vllm import VLLMSampler
        return VLLMSampler(args.model, tc.sampler, tc.data.max_prompt_len + tc.grpo.max_new_tokens, args.seed)
    import torch

    from ds_twocircuit.sampler.hf import HFSampler
    return HFSampler(args.model, tc.model.attn_implementation, tc.sampler.dtype,
                     "cuda" if torch.cuda.is_available() else None)


def load_benchmark(name: str, source: str, tc, tokenizer):
    """→ (prompts, answers, the task (its scorer and close), rows left out by data.max_prompt_len)."""
    from dataclasses import replace

    from ds_twocircuit.data import build_task
    data = tc.data if name == "held_out" else replace(tc.data, dataset=source, eval_dataset=source, split="test",
                                                       eval_split="test", eval_size=10 ** 9)
    task = build_task(data, tokenizer)
    held = task.held_out
    return [task.prompt(p) for p in held["problem"]], list(held["answer"]), task, task.left_out["held_out"]


def evaluate(args, run) -> list[dict]:
    from tqdm import tqdm

    from ds_twocircuit.evaluation import avg_at_k, hits
    tc, results = run.tc, []
    sampler = build_sampler(args, tc)
    specs = benchmark_specs(args.bench, args.k)
    bar = tqdm(total=sum(1 + (k > 0) for *_, k in specs), desc="evaluate")
    for name, source, k in specs:
        prompts, answers, task, left_out = load_benchmark(name, source, tc, sampler.tokenizer)
        row = {"bench": name, "source": source or tc.data.eval_dataset or tc.data.dataset, "n": len(prompts),
               "left_out": left_out, "k": k}
        g = tc.grpo.max_new_tokens
        row["mean@1"] = float(hits(sampler, prompts, answers, task.score, 1, greedy=True, max_new_tokens=g).mean())
        bar.update()
        if k:
            row.update(avg_at_k(hits(sampler, prompts, answers, task.score, k, greedy=False, max_new_tokens=g,
                                     temperature=args.temperature, seed=args.seed)))
            bar.update()
        task.close()
        results.append(row)
    bar.close()
    return results


def codec_check(args, run) -> list[dict]:
    """Held-out greedy accuracy generated through PRF and a static SVD basis at each keep ratio."""
    import torch

    from ds_twocircuit.codec.boundary import Codec
    from ds_twocircuit.codec.geometry import cut_layers, keep_count
    from ds_twocircuit.codec.inference import static_bases, through_codec
    from ds_twocircuit.data import build_task
    from ds_twocircuit.sampler.hf import HFSampler, greedy_accuracy
    tc = run.tc
    sampler = HFSampler(args.model, tc.model.attn_implementation)
    task = build_task(tc.data, sampler.tokenizer)
    prompts, answers = [task.prompt(p) for p in task.held_out["problem"]], task.held_out["answer"]
    d, cuts = sampler.model.config.hidden_size, cut_layers(tc.model.layers_per_stage)
    budgets = [float(b) for b in args.codec_budgets.split(",")]
    bad = [b for b in budgets if not 1 <= keep_count(0, b, d) <= d]
    if bad:
        sys.exit(f"--codec-budgets {args.codec_budgets}: {bad} give no channel or more than d = {d}")
    accuracy = lambda: greedy_accuracy(sampler, prompts, answers, task.score, tc.grpo.max_new_tokens)
    calib = task.train.select(range(min(args.calibration, len(task.train))))
    enc = sampler.tokenizer([task.prompt(p) + a for p, a in zip(calib["problem"], calib["answer"])],
                            return_tensors="pt", padding=True, add_special_tokens=False)
    out = [{"codec": "dense", "keep_ratio": 1.0, "k": d, "acc": accuracy()}]
    with torch.no_grad():
        for ratio in budgets:
            k = keep_count(0, ratio, d)
            with through_codec(sampler.model, Codec(name="prf", d=d, k=k, seed=tc.codec.seed, cuts=cuts)):
                out.append({"codec": "prf", "keep_ratio": ratio, "k": k, "acc": accuracy()})
            svd = Codec(name="lowrank", d=d, k=k, cuts=cuts)
            svd.set_bases(static_bases(sampler.model, enc, cuts, k))
            with through_codec(sampler.model, svd):
                out.append({"codec": "static SVD", "keep_ratio": ratio, "k": k, "acc": accuracy()})
    return out


def table(results: list[dict], temperature: float) -> str:
    lines = [f"| benchmark | n | mean@1 (greedy) | avg@k (T = {temperature}) | spread over k | pass@k | k |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        sampled = (f"{r['avg@k']:.3f} | ±{r['spread']:.3f} | {r['pass@k']:.3f}" if r["k"] else "– | – | –")
        lines.append(f"| {r['bench']} | {r['n']} | {r['mean@1']:.3f} | {sampled} | {r['k']} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    from ds_twocircuit.config import load_or_exit, load_recipe, load_run
    if args.run:
        run = load_or_exit(load_run, pathlib.Path(args.run), args.overrides)
    else:
        run = load_or_exit(load_recipe, args.ds_config or "ds_configs/prf95.json", args.overrides)
    if args.run and args.exported and not pathlib.Path(args.model).is_dir():
        sys.exit(f"--run {args.run}: no exported model/ there yet (a run exports it at its end)")
    benchmark_specs(args.bench, args.k)                  # a bad --bench fails before any model loads
    import torch
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
    results = evaluate(args, run)
    print(f"\n{args.model}\n\n{table(results, args.temperature)}")
    report = {"model": args.model, "temperature": args.temperature, "seed": args.seed, "results": results}
    if args.codec_budgets:
        report["codec"] = codec_check(args, run)
        print("\n| generation (held_out, greedy) | keep | k | accuracy |\n|---|---|---|---|")
        for r in report["codec"]:
            print(f"| {r['codec']} | {r['keep_ratio']:.2f} | {r['k']} | {r['acc']:.3f} |")
    out = pathlib.Path(args.out) if args.out else pathlib.Path(args.model).parent / "eval.json"
    out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
