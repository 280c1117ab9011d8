"""Slow links, measured: every pipeline stage in its own network namespace behind a rate-limited link.

    sudo python launch/bench_links.py [--rates unshaped 1gbit 100mbit 10mbit] [--out runs/bench_links]

Creates one network namespace per stage, each joined to one bridge by a veth pair, with Linux `tc`
token-bucket shaping (`tbf`) on every stage's egress, and runs the same GRPO pipeline steps (a
reference-policy eval pass and a train_batch, as `trainer.py` does, minus the sampler) with each rank
inside its namespace (torch.distributed env:// rendezvous over the bridge). One launch serves every
phase: the ranks stop at a handshake before each (codec, rate) phase while this process re-shapes the
links. It prints, side by side: step time per run, bytes per boundary per step (from the p2p wire
accounting and from the interfaces' own counters), the dense/prf ratio at each rate and each run's
ratio to its own unshaped time. `--scaling` sweeps tokens per step at one rate instead;
`--overlap` sweeps the number of micro-batches per step at a fixed batch (`--micro-batches`, with
`--p2p isend` beside DeepSpeed's blocking sends) and prints, per codec and micro-batch count, the
fitted transfers on the critical path β against a flow shop's (M + S − 2)/M.
Each compressed codec (`--codecs`: prf, the 5 % PRF of prf95.json; rotated, the rotated low-bit code
at `--fwd-bits/--bwd-coords/--bwd-bits`, and the width's levers `--fwd-tile/--fwd-levels/--bwd-rank`) gets its own launch with its own dense phases beside it, so
every ratio compares two phases of one launch on the same links.

Needs root and iproute2. It uses addresses only on the namespaces it creates (10.231.137.0/24),
removes everything it created on exit, error or Ctrl-C, and every wait is bounded.
"""
import argparse
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from netns import Namespaces, parse_rate  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]

# ---- the ranks ---------------------------------------------------------------------------------------
def worker(a) -> None:
    """One pipeline rank inside its namespace: all phases, with a handshake before each. Each step is
    the trainer's pair of pipeline passes (pipeline/passes.py): the reference policy's log-probs and the update."""
    import contextlib

    import torch
    import torch.distributed as dist

    from ds_twocircuit.pipeline import comm, passes
    from ds_twocircuit.config import TwoCircuitConfig
    from ds_twocircuit.pipeline.engine import build_pipeline, init_distributed
    from ds_twocircuit.grpo.loss import LossCoefs
    from ds_twocircuit.pipeline import wire

    torch.set_num_threads(1)
    init_distributed(timeout_s=1800)
    flush = nonblocking_sends() if a.p2p[0] == "isend" else (lambda: None)
    phases = json.loads(a.phases)
    tc = TwoCircuitConfig()
    tc.model.layers_per_stage = [a.layers_per_stage] * a.stages
    tc.codec.name, tc.codec.keep_ratio = a.codecs[0], a.keep_ratio      # the dense phases run it with the codec off
    tc.codec.fwd_coords, tc.codec.fwd_bits, tc.codec.bwd_coords, tc.codec.bwd_bits = \
        a.fwd_coords, a.fwd_bits, a.bwd_coords, a.bwd_bits
    tc.codec.fwd_tile, tc.codec.fwd_levels, tc.codec.bwd_rank = a.fwd_tile, a.fwd_levels, a.bwd_rank
    p = build_pipeline(a.model_dir, tc, {
        "train_micro_batch_size_per_gpu": a.micro, "gradient_accumulation_steps": a.gas, "gradient_clipping": 0.0,
        "steps_per_print": 10**9, "optimizer": {"type": "AdamW", "params": {"lr": 1e-6, "torch_adam": True}}})
    base = [q.detach().clone() for q in p.pipe.parameters()]
    rank, ctl = dist.get_rank(), pathlib.Path(a.control)
    for i, ph in enumerate(phases):
        batch = synthetic_rollout(a.micro * a.gas, ph["seq"], p.pipe.config.vocab_size)
        z = torch.zeros_like(batch.resp_NT1)
        if rank == 0:
            (ctl / f"want_{i}").touch()
            wait_for(ctl / f"go_{i}", a.phase_timeout)
        comm.barrier()
        times, wire_rows = [], []
        for s in range(a.warmup + a.steps):
            codec_off = p.codec.off() if ph["codec"] == "dense" else contextlib.nullcontext()
            with codec_off, p.codec.keyed(s), wire.counting() as w, p.codec.counting() as n:
                comm.barrier()
                t0 = time.perf_counter()
                passes.logprobs(p, batch, base)           # the reference pass, as in every GRPO step
                passes.update(p, batch, batch.num_response_tokens, z, z, LossCoefs(), old_is_current=True)
                flush()
                comm.barrier()
            if s >= a.warmup:
                times.append(time.perf_counter() - t0)
                wire_rows.append([w.fwd, w.bwd, n.payload, n.dense])
        v = torch.zeros(a.stages, 4, dtype=torch.float64)
        v[p.stage] = torch.tensor(wire_rows, dtype=torch.float64).mean(0)
        comm.sum_over_world(v)
        if rank == 0:
            tmp = ctl / f".result_{i}.json.tmp"   # renamed into place: the controller polls for the name
            tmp.write_text(json.dumps({"phase": ph, "step_s": times, "per_stage": v.tolist()}))
            os.replace(tmp, ctl / f"result_{i}.json")


def nonblocking_sends():
    """The `--p2p isend` experiment: DeepSpeed's pipeline sends (p2p.send, a blocking dist.send)
    become dist.isend, so a stage computes its next micro-batch while its last one is still on the
    wire. Every send DeepSpeed makes hands over a tensor it does not write again (a stage's fresh
    outputs, an input's fresh .grad, shape metadata), so keeping a reference until the send
    completes is enough. → flush(): wait for every send in flight (called after each step's passes)."""
    import torch.distributed as dist
    from deepspeed.runtime.pipe import p2p
    pending = []

    def send(tensor, dest_stage, async_op=False):
        pending.append((dist.isend(tensor, p2p._grid.stage_to_global(stage_id=dest_stage)), tensor))

    def flush():
        for work, _ in pending:
            work.wait()
        pending.clear()

    p2p.send = send
    return flush


def synthetic_rollout(n: int, seq: int, vocab: int):
    """A fixed batch of n sequences of `seq` tokens: the second half is the scored response."""
    import torch

    from ds_twocircuit.grpo.rollouts import Rollout
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (n, seq), generator=g)
    resp = torch.zeros(n, seq - 1)
    resp[:, seq // 2:] = 1.0
    return Rollout(ids, torch.ones(n, seq, dtype=torch.long), resp, torch.zeros(n, seq - 1), torch.zeros(n),
                   torch.randn(n, generator=g), torch.arange(n))


def wait_for(path: pathlib.Path, timeout: float) -> None:
    deadline = time.time() + timeout
    while not path.exists():
        if time.time() > deadline:
            raise TimeoutError(f"waited {timeout:.0f}s for {path}")
        time.sleep(0.05)


# ---- the driver --------------------------------------------------------------------------------------
def build_model(a) -> str:
    from ds_twocircuit.config import TinyModelConfig
    from ds_twocircuit.model.tiny import ensure_tiny_model
    heads = max(1, a.hidden // 128)
    return ensure_tiny_model(TinyModelConfig(hidden_size=a.hidden, num_layers=a.stages * a.layers_per_stage,
                                             num_heads=heads, num_kv_heads=max(1, heads // 6),
                                             intermediate_size=a.intermediate, warmup_steps=0), eval_size=8)


def run_launches(a, phases: list[dict]) -> list[dict]:
    """One launch per compressed codec, micro-batch count and p2p mode, running its phases and the
    dense ones of the same count and mode, in the given order."""
    compressed = [c for c in dict.fromkeys(ph["codec"] for ph in phases) if c != "dense"] or ["prf"]   # dense alone: prf's engine
    keys = [(c, m, mode) for m, mode in dict.fromkeys((ph.get("m", a.gas), ph.get("p2p", "deepspeed")) for ph in phases)
            for c in compressed]
    results = []
    for codec, m, mode in keys:
        print(f"launch: dense and {codec}, {m} micro-batches, {mode} sends", flush=True)
        mine = [ph for ph in phases if ph["codec"] in ("dense", codec) and ph.get("m", a.gas) == m
                and ph.get("p2p", "deepspeed") == mode]
        results += [{**r, "launch": codec} for r in run_phases(micro_batches(a, m, mode), codec, mine)]
    return results


def micro_batches(a, m: int, mode: str):
    """`a` for a launch of m micro-batches per step at the same sequences per step, with `mode` sends."""
    seqs = a.micro * a.gas
    if seqs % m:
        raise SystemExit(f"--micro-batches {m} does not divide {seqs} sequences per step (--micro x --gas)")
    return argparse.Namespace(**{**vars(a), "micro": seqs // m, "gas": m, "p2p": mode})


def run_phases(a, codec: str, phases: list[dict]) -> list[dict]:
    """Start the ranks in their namespaces, re-shape links at each handshake, collect the results."""
    model_dir = build_model(a)
    ctl = pathlib.Path(a.out) / "control"
    shutil.rmtree(ctl, ignore_errors=True)
    ctl.mkdir(parents=True)
    prefix = f"tcl{os.getpid() % 100000}"
    results, procs = [], []
    with Namespaces(a.stages, prefix) as net:
        try:
            port = 29600 + os.getpid() % 1000
            for r in range(a.stages):
                env = {**os.environ, "RANK": str(r), "WORLD_SIZE": str(a.stages), "LOCAL_RANK": "0",
                       "MASTER_ADDR": net.addr(0), "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": net.peer(r),
                       "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
                cmd = ["ip", "netns", "exec", net.ns[r], sys.executable, __file__, "--worker", "--model-dir", model_dir,
                       "--control", str(ctl), "--phases", json.dumps(phases), "--codecs", codec, *worker_args(a)]
                log = open(pathlib.Path(a.out) / f"rank{r}.log", "w")
                procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
            for i, ph in enumerate(phases):
                wait_alive(ctl / f"want_{i}", procs, a.phase_timeout)
                net.shape(None if ph["rate"] == "unshaped" else ph["rate"])
                tx0 = net.tx_bytes()
                (ctl / f"go_{i}").touch()
                wait_alive(ctl / f"result_{i}.json", procs, a.phase_timeout)
                res = json.loads((ctl / f"result_{i}.json").read_text())
                res["iface_bytes_per_step"] = [(b - b0) / (a.warmup + a.steps) for b, b0 in zip(net.tx_bytes(), tx0)]
                results.append(res)
                print(f"  {ph['codec']:>5} @ {ph['rate']:>8} seq {ph['seq']}: {median(res['step_s']):.2f} s/step",
                      flush=True)
            for p in procs:
                p.wait(timeout=a.phase_timeout)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
    return results


def wait_alive(path: pathlib.Path, procs, timeout: float) -> None:
    deadline = time.time() + timeout
    while not path.exists():
        dead = [p for p in procs if p.poll() not in (None, 0)]
        if dead or time.time() > deadline:
            raise RuntimeError(f"ranks failed or stalled before {path.name} (see rank*.log)")
        time.sleep(0.1)


def worker_args(a) -> list[str]:
    return ["--stages", str(a.stages), "--layers-per-stage", str(a.layers_per_stage), "--micro", str(a.micro),
            "--gas", str(a.gas), "--keep-ratio", str(a.keep_ratio), "--steps", str(a.steps), "--warmup",
            str(a.warmup), "--phase-timeout", str(a.phase_timeout), "--fwd-coords", str(a.fwd_coords), "--fwd-bits",
            str(a.fwd_bits), "--bwd-coords", str(a.bwd_coords), "--bwd-bits", str(a.bwd_bits), "--fwd-tile",
            str(a.fwd_tile), "--fwd-levels", a.fwd_levels, "--bwd-rank", str(a.bwd_rank), "--p2p", a.p2p]


def median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2]


def report(results: list[dict], stages: int) -> str:
    """The rate table per launch: time, bytes per boundary, dense/codec, each run against its own
    unshaped time; the dense and the compressed phase of a row come from the same launch."""
    lines = []
    for launch in dict.fromkeys(r.get("launch", "prf") for r in results):
        by = {(r["phase"]["codec"], r["phase"]["rate"], r["phase"]["seq"]): r for r in results
              if r.get("launch", "prf") == launch}
        c = launch
        lines += [f"| rate | seq | dense s/step | {c} s/step | dense / {c} | dense / own unshaped | {c} / own unshaped |"
                  f" dense MB/boundary/step (p2p, iface) | {c} MB/boundary/step (p2p, iface) |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for (codec, rate, seq), r in by.items():
            if codec != "dense" or (c, rate, seq) not in by:
                continue
            p = by[(c, rate, seq)]
            td, tp = median(r["step_s"]), median(p["step_s"])
            ud = median(by.get(("dense", "unshaped", seq), r)["step_s"])
            up = median(by.get((c, "unshaped", seq), p)["step_s"])
            lines.append(f"| {rate} | {seq} | {td:.2f} | {tp:.2f} | {td / tp:.2f} | {td / ud:.2f} | {tp / up:.2f} | "
                         f"{boundary_mb(r, stages)} | {boundary_mb(p, stages)} |")
        lines.append("")
    return "\n".join(lines).strip()


def overlap_report(results: list[dict], stages: int) -> str:
    """Per codec, micro-batch count M and p2p mode: T0 (unshaped s/step), the fitted β of
    T = T0 + β·B/r, and a flow shop's transfer-bound (M + S − 2)/M: each pass's M micro-batches
    cross S − 1 links in a chain, so a link-bound step carries M transfers on its busiest link plus
    S − 2 on the way in and out."""
    lines = ["| codec | p2p | micro-batches M | T0 s/step | " + " | ".join(
        f"{r} s/step" for r in dict.fromkeys(x["phase"]["rate"] for x in results if x["phase"]["rate"] != "unshaped"))
        + " | fitted β | (M+S−2)/M |"]
    lines.append("|" + "---|" * (lines[0].count("|") - 1))
    keys = dict.fromkeys((r["phase"]["codec"], r["phase"].get("p2p", "deepspeed"), r["phase"].get("m")) for r in results)
    for codec, mode, m in keys:
        rows = [r for r in results if (r["phase"]["codec"], r["phase"].get("p2p", "deepspeed"), r["phase"].get("m"))
                == (codec, mode, m)]
        fit = fit_link_model(rows, stages)
        beta, t0 = next(iter(fit.values()))["beta"], next(iter(fit.values()))["t0"]
        shaped = " | ".join(f"{median(r['step_s']):.2f}" for r in rows if r["phase"]["rate"] != "unshaped")
        lines.append(f"| {codec} | {mode} | {m} | {t0:.2f} | {shaped} | {beta:.2f} | {(m + stages - 2) / m:.2f} |")
    return "\n".join(lines)


def cut_bytes(r: dict, stages: int) -> tuple[float, float]:
    """Mean over the cuts of fwd+bwd bytes crossing a cut per step: (p2p accounting, interface counters)."""
    ps = r["per_stage"]
    p2p = sum(ps[s][0] for s in range(stages - 1)) + sum(ps[s][1] for s in range(1, stages))
    return p2p / (stages - 1), sum(r["iface_bytes_per_step"]) / (stages - 1)


def boundary_mb(r: dict, stages: int) -> str:
    p2p, iface = cut_bytes(r, stages)
    return f"{p2p / 1e6:.3f}, {iface / 1e6:.3f}"


def fit_link_model(results: list[dict], stages: int) -> dict:
    """Step time model T = T0 + β·B/r per codec: T0 its unshaped time, B the bytes one cut carries per step
    (both directions), r the link rate in bytes/s; β (least squares through the shaped points) is the
    number of cut transfers on the critical path after the pipeline's overlap."""
    out = {}
    for launch, codec in dict.fromkeys((r.get("launch", "prf"), r["phase"]["codec"]) for r in results):
        rows = [r for r in results if r["phase"]["codec"] == codec and r.get("launch", "prf") == launch]
        t0 = median(next(r for r in rows if r["phase"]["rate"] == "unshaped")["step_s"])
        xs, ys = [], []
        for r in rows:
            if r["phase"]["rate"] != "unshaped":
                b = cut_bytes(r, stages)[0]
                xs.append(b / (parse_rate(r["phase"]["rate"]) / 8))
                ys.append(median(r["step_s"]) - t0)
        beta = sum(x * y for x, y in zip(xs, ys)) / max(sum(x * x for x in xs), 1e-12)
        out[codec if codec != "dense" else f"dense ({launch} launch)"] = {"t0": t0, "beta": beta}
    return out


def print_projection(a) -> None:
    """The fitted model, and projection.py's 1.5B table with the fitted dense β at this run's M."""
    import projection
    results = json.loads((pathlib.Path(a.out) / "results.json").read_text())
    fit = fit_link_model(results, a.stages)
    print("fitted T = T0 + β·B/r: " + ", ".join(f"{c}: T0 {v['t0']:.2f} s, β {v['beta']:.2f}" for c, v in fit.items()))
    beta = next((v for c, v in fit.items() if c.startswith("dense")), next(iter(fit.values())))["beta"]
    text = projection.table(projection.parse(["--beta", f"{beta:.4f}", "--bench-m", str(a.gas)]))
    (pathlib.Path(a.out) / "projection.md").write_text(text + "\n")
    print(text)


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", nargs="+", default=["unshaped", "1gbit", "100mbit", "10mbit"])
    ap.add_argument("--codecs", nargs="+", default=["dense", "prf", "rotated"], choices=["dense", "prf", "rotated"])
    ap.add_argument("--seq", type=int, default=32, help="tokens per sequence")
    ap.add_argument("--scaling", nargs="*", type=int, default=None, help="sequence lengths to sweep at --scaling-rate")
    ap.add_argument("--scaling-rate", default="10mbit")
    ap.add_argument("--overlap", action="store_true", help="sweep --micro-batches (and --p2p) at a fixed batch")
    ap.add_argument("--micro-batches", nargs="+", type=int, default=[4, 8, 16])
    ap.add_argument("--p2p", nargs="+", default=["deepspeed"], choices=["deepspeed", "isend"],
                    help="pipeline sends: DeepSpeed's blocking ones, or the isend experiment")
    ap.add_argument("--stages", type=int, default=8)
    ap.add_argument("--layers-per-stage", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--micro", type=int, default=2)
    ap.add_argument("--gas", type=int, default=4)
    ap.add_argument("--keep-ratio", type=float, default=0.05)
    ap.add_argument("--fwd-coords", type=int, default=0, help="rotated: coordinates forward (0: all d)")
    ap.add_argument("--fwd-bits", type=int, default=4, help="rotated: bits per coordinate forward")
    ap.add_argument("--bwd-coords", type=int, default=None, help="rotated: coordinates back (default 5/8 of d)")
    ap.add_argument("--bwd-bits", type=int, default=2, help="rotated: bits per coordinate back")
    ap.add_argument("--fwd-tile", type=int, default=0, help="rotated: coordinates per 8-bit scale forward (0: per token)")
    ap.add_argument("--fwd-levels", default="uniform", choices=["uniform", "gauss"], help="rotated: forward levels")
    ap.add_argument("--bwd-rank", type=int, default=0, help="rotated: > 0 codes the backward at this rank "
                    "(frontier_wide.json: --fwd-bits 2 --fwd-tile 64 --fwd-levels gauss --bwd-rank 2)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--phase-timeout", type=float, default=300)
    ap.add_argument("--out", default="runs/bench_links")
    ap.add_argument("--project", action="store_true", help="only print the fitted model and the 1.5B projection "
                    "from OUT/results.json")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--control", help=argparse.SUPPRESS)
    ap.add_argument("--phases", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv=None) -> None:
    a = parse(argv)
    if a.worker:
        return worker(a)
    if a.project:
        return print_projection(a)
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        sys.exit("bench_links needs root, iproute2 (ip) and tc")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # unwind through the cleanup on kill
    pathlib.Path(a.out).mkdir(parents=True, exist_ok=True)
    a.bwd_coords = a.hidden * 5 // 8 if a.bwd_coords is None else a.bwd_coords
    if a.overlap:
        phases = [{"codec": c, "rate": r, "seq": a.seq, "m": m, "p2p": mode} for mode in a.p2p
                  for m in a.micro_batches for r in a.rates for c in a.codecs]
    elif a.scaling:
        phases = [{"codec": c, "rate": r, "seq": s} for s in a.scaling for r in ("unshaped", a.scaling_rate)
                  for c in a.codecs]
    else:
        phases = [{"codec": c, "rate": r, "seq": a.seq} for r in a.rates for c in a.codecs]
    t0 = time.time()
    results = run_launches(a, phases)
    table = overlap_report(results, a.stages) if a.overlap else report(results, a.stages)
    (pathlib.Path(a.out) / "results.json").write_text(json.dumps(results, indent=1))
    (pathlib.Path(a.out) / "table.md").write_text(table + "\n")
    print(table)
    if not (a.scaling or a.overlap):
        print_projection(a)
    seqs = "/".join(map(str, a.scaling)) if a.scaling else str(a.seq)
    print(f"({len(phases)} phases in {time.time() - t0:.0f} s; hidden {a.hidden}, {a.stages} stages, "
          f"{a.micro * a.gas} sequences x {seqs} tokens per step)")


if __name__ == "__main__":
    main()
