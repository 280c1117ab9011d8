"""Padding, measured: a GRPO step's pipeline passes on a batch with long-tailed responses, micro-batches
of one padded length against micro-batches cut by length and trimmed, side by side in one launch.

    python launch/bench_padding.py [--recipes dense prf95] [--model DIR] [--groups 8 --group 8 --micro 8]
                                   [--mean-len 27.5 --cap 154 --prompt 3 16] [--repeats 2]
                                   [--out runs/bench_padding]

One `deepspeed --num_gpus 8` launch per recipe (ds_configs/<recipe>.json: its codec, β and precision;
the batch and micro-batch set here) on `--model` (default: the benchmark's fixed starting model).
Each launch builds one seeded batch (pipeline/layout.py `long_tailed_spans`: by default the
deployment's 550-token mean under a 3072 cap and prompts of 60–320 tokens, scaled by 1/20 to what
2 CPU cores run in minutes; random token ids) and runs the trainer's passes
of an on-policy step over it, the reference log-probs (β > 0) and the update, alternating the two
layouts (train.trim_micro_batches = never, always) `--repeats` times. Per recipe and layout it
prints: boundary bytes per step (p2p counts, both directions, summed over ranks), token slots the
passes computed, seconds per step (the median), the trimmed/padded ratios, and which layout the
rule (`auto`) picks for this batch.
"""
import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
START = ROOT.parent / "shared" / "models" / "wide-ws200-e2048"


def worker(a) -> None:

    import torch
    import torch.distributed as dist

    from ds_twocircuit.config import load_config
    from ds_twocircuit.grpo.loss import LossCoefs
    from ds_twocircuit.grpo.rollouts import Rollout
    from ds_twocircuit.model.pipe import mask_from_span
    from ds_twocircuit.pipeline import passes
    from ds_twocircuit.pipeline.engine import build_pipeline, init_distributed
    from ds_twocircuit.pipeline.layout import choose_layout, long_tailed_spans
    from ds_twocircuit.pipeline import wire

    run = load_config(a.ds_config, [f"model.path={a.model}", "log.wandb=false"], world_size=8)
    init_distributed(run.tc.train.collective_timeout)
    p = build_pipeline(a.model, run.tc, run.ds)
    coefs = LossCoefs.from_config(run.tc.grpo)
    span, T, P = long_tailed_spans(a.groups, a.group, a.mean_len, a.cap, tuple(a.prompt), seed=0)
    attn = mask_from_span(span, T)
    g = torch.Generator().manual_seed(1)
    resp = torch.zeros(len(span), T - 1)
    for i, (lo, hi) in enumerate(span.tolist()):
        resp[i, P - 1:hi - 1] = 1.0
    batch = Rollout(ids_NT=torch.randint(3, p.pipe.config.vocab_size, (len(span), T), generator=g) * attn,
                    attn_NT=attn, resp_NT1=resp, sampler_logp_NT1=torch.zeros_like(resp),
                    rewards_N=torch.zeros(len(span)), adv_N=torch.randn(len(span), generator=g),
                    sample_id_N=torch.arange(len(span)))
    base = [q.detach().clone() for q in p.pipe.parameters()]
    zero = torch.zeros_like(resp)
    rows = []
    for rep in range(a.repeats):
        for mode in ("never", "always"):
            p.trim = mode
            dist.barrier()
            t0 = time.perf_counter()
            with p.codec.keyed(rep), wire.counting() as w:
                ref = passes.logprobs(p, batch, base) if coefs.kl_coef > 0 else zero
                passes.update(p, batch, float(resp.sum()), zero, ref, coefs, old_is_current=True)
            dist.barrier()
            seconds = time.perf_counter() - t0
            sent = torch.tensor([float(w.fwd), float(w.bwd)], dtype=torch.float64)
            dist.all_reduce(sent)
            lay = passes.plan(p, batch)
            rows.append({"layout": "trimmed" if mode == "always" else "padded", "repeat": rep, "seconds": seconds,
                         "bytes_fwd": float(sent[0]), "bytes_bwd": float(sent[1]),
                         "slots": lay.positions() * (2 if coefs.kl_coef > 0 else 1)})
    p.trim = "auto"
    auto = passes.plan(p, batch)
    if dist.get_rank() == 0:
        real = int((span[:, 1] - span[:, 0]).sum())
        at_cap = int(((span[:, 1] - P) == a.cap).sum())
        pathlib.Path(a.result).write_text(json.dumps({
            "rows": rows, "auto": "trimmed" if auto.trimmed else "padded",
            "sequences": len(span), "T": T, "real_tokens": real, "at_cap": at_cap,
            "micro": p.micro, "passes": 2 if coefs.kl_coef > 0 else 1}))


def report(results: dict) -> str:
    lines = ["| recipe | layout | boundary MB / step (fwd + bwd) | token slots / step | s / step | "
             "auto picks |", "|---|---|---|---|---|---|"]
    for recipe, r in results.items():
        by = {k: [x for x in r["rows"] if x["layout"] == k] for k in ("padded", "trimmed")}
        med = {k: {m: statistics.median(x[m] for x in v) for m in ("seconds", "bytes_fwd", "bytes_bwd", "slots")}
               for k, v in by.items()}
        for k in ("padded", "trimmed"):
            m = med[k]
            lines.append(f"| {recipe} | {k} | {(m['bytes_fwd'] + m['bytes_bwd']) / 1e6:.2f} | {m['slots']:.0f} | "
                         f"{m['seconds']:.2f} | {r['auto'] if k == 'padded' else ''} |")
        p, t = med["padded"], med["trimmed"]
        lines.append(f"| {recipe} | trimmed / padded | {(t['bytes_fwd'] + t['bytes_bwd']) / (p['bytes_fwd'] + p['bytes_bwd']):.3f} | "
                     f"{t['slots'] / p['slots']:.3f} | {t['seconds'] / p['seconds']:.3f} | |")
    r = next(iter(results.values()))
    lines.append(f"\n{r['sequences']} sequences ({r['at_cap']} at the cap), padded length {r['T']}, "
                 f"{r['real_tokens']} real tokens ({r['real_tokens'] / (r['sequences'] * r['T']):.3f} of the padded "
                 f"slots), micro-batches of {r['micro']}, {r['passes']} pass(es) a step")
    return "\n".join(lines)


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipes", nargs="+", default=["dense", "prf95"])
    ap.add_argument("--model", default=str(START))
    ap.add_argument("--groups", type=int, default=8, help="prompts")
    ap.add_argument("--group", type=int, default=8, help="samples per prompt")
    ap.add_argument("--micro", type=int, default=8, help="sequences per micro-batch")
    ap.add_argument("--mean-len", type=float, default=27.5, help="mean response length before the cap")
    ap.add_argument("--cap", type=int, default=154, help="response length cap")
    ap.add_argument("--prompt", type=int, nargs=2, default=[3, 16], help="prompt lengths, uniform")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default="runs/bench_padding")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ds-config", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv=None) -> None:
    a = parse(argv)
    if a.worker:
        return worker(a)
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    shared = ["--model", a.model, "--groups", str(a.groups), "--group", str(a.group), "--mean-len", str(a.mean_len),
              "--cap", str(a.cap), "--prompt", *map(str, a.prompt), "--repeats", str(a.repeats)]
    results = {}
    for recipe in a.recipes:
        result, config = out / f"{recipe}.json", out / f"{recipe}.ds.json"
        ds = json.loads((ROOT / f"ds_configs/{recipe}.json").read_text())
        ds["train_micro_batch_size_per_gpu"] = a.micro
        ds["twocircuit"]["grpo"].update(prompts_per_step=a.groups, group_size=a.group)
        config.write_text(json.dumps(ds, indent=1))
        cmd = ["deepspeed", "--num_gpus", "8", "--master_port", os.environ.get("MASTER_PORT", "29531"),
               str(ROOT / "launch/bench_padding.py"), "--worker", "--ds-config", str(config),
               "--result", str(result), *shared]
        with open(out / f"{recipe}.log", "w") as log:
            subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                           env={**os.environ, "PYTHONPATH": str(ROOT)})
        results[recipe] = json.loads(result.read_text())
    table = report(results)
    (out / "table.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
