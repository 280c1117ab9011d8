"""Held-out accuracy of an HF checkpoint, dense and generating through the boundary codec.

    python launch/evaluate.py --model runs/prf95/model [--ds-config ds_configs/prf95.json]
                              [--budgets 0.05,0.25] [--out eval_codec.json] [key=value ...]

The task, held-out split, generation length and cut layout come from the recipe's `twocircuit`
block (the same one training used). Rows: dense; prf at each budget (keep ratio); a static SVD basis
at each budget (the top-k directions of the checkpoint's own activations on teacher-forced training
rows). Greedy mean@1, one process, no DeepSpeed. Prints a markdown table and writes it as JSON.
"""
import argparse
import json
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="HF checkpoint directory (a run's model/ export) or hub name")
    p.add_argument("--ds-config", default="ds_configs/prf95.json", help="recipe for the task and the cuts")
    p.add_argument("--budgets", default="0.05,0.25", help="comma-separated keep ratios")
    p.add_argument("--calibration", type=int, default=256, help="training rows for the static SVD bases")
    p.add_argument("--out", default=None, help="JSON output (default: <model>/../eval_codec.json)")
    p.add_argument("overrides", nargs="*", help="dotted twocircuit keys, e.g. data.eval_size=256")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    from ds_twocircuit.codec.geometry import cut_layers, keep_count
    from ds_twocircuit.config import load_or_exit, load_recipe
    run = load_or_exit(load_recipe, args.ds_config, args.overrides)
    import torch
    from tqdm import tqdm

    from ds_twocircuit.codec.boundary import Codec
    from ds_twocircuit.codec.inference import static_bases, through_codec
    from ds_twocircuit.data import build_task
    from ds_twocircuit.sampler.hf import HFSampler, greedy_accuracy

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
    tc = run.tc
    sampler = HFSampler(args.model, tc.model.attn_implementation)
    task = build_task(tc.data, sampler.tokenizer)
    held = task.held_out
    prompts, answers = [task.prompt(p) for p in held["problem"]], held["answer"]
    d = sampler.model.config.hidden_size
    cuts = cut_layers(tc.model.layers_per_stage)
    budgets = [float(b) for b in args.budgets.split(",")]
    bad = [b for b in budgets if not 1 <= keep_count(0, b, d) <= d]
    if bad:
        sys.exit(f"--budgets {args.budgets}: {bad} give no channel or more than d = {d}")

    def accuracy() -> float:
        return greedy_accuracy(sampler, prompts, answers, task.reward, tc.grpo.max_new_tokens)

    calib = task.train.select(range(min(args.calibration, len(task.train))))
    enc = sampler.tokenizer([task.prompt(p) + a for p, a in zip(calib["problem"], calib["answer"])],
                            return_tensors="pt", padding=True, add_special_tokens=False)
    results = [{"codec": "dense", "keep_ratio": 1.0, "k": d, "acc": accuracy()}]
    for ratio in tqdm(budgets, desc="budgets"):
        k = keep_count(0, ratio, d)
        prf = Codec(name="prf", d=d, k=k, seed=tc.codec.seed, cuts=cuts)
        with through_codec(sampler.model, prf):
            results.append({"codec": "prf", "keep_ratio": ratio, "k": k, "acc": accuracy()})
        svd = Codec(name="lowrank", d=d, k=k, cuts=cuts)
        svd.set_bases(static_bases(sampler.model, enc, cuts, k))
        with through_codec(sampler.model, svd):
            results.append({"codec": "static SVD", "keep_ratio": ratio, "k": k, "acc": accuracy()})
    print(f"\nheld-out greedy accuracy of {args.model} (n={len(held)}, {len(cuts)} cuts)\n")
    print("| generation | keep | k of d | accuracy |\n|---|---|---|---|")
    for r in results:
        print(f"| {r['codec']} | {r['keep_ratio']:.2f} | {r['k']} of {d} | {r['acc']:.3f} |")
    out = pathlib.Path(args.out) if args.out else pathlib.Path(args.model).parent / "eval_codec.json"
    out.write_text(json.dumps({"model": args.model, "n": len(held), "cuts": cuts, "results": results}, indent=1))


if __name__ == "__main__":
    main()
