"""Shared fixtures: the embedded base model built small and once per session, real launches."""
import json
import math
import os
import pathlib
import shutil
import socket
import subprocess

import pytest
import torch
from safetensors.torch import load_file

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = ROOT / "tests" / "configs" / "tiny.json"
# every launch of the suite checks that each pipeline receive agrees with its send in dtype and element
# count (pipeline/wire.py): NCCL's rule, which gloo does not enforce
os.environ.setdefault("DS_TWOCIRCUIT_STRICT_WIRE", "1")


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """A private model cache: the tests build their own small embedded model (about 10 s).
    DS_TWOCIRCUIT_TEST_CACHE names a directory to keep it in between sessions (local iteration)."""
    keep = os.environ.get("DS_TWOCIRCUIT_TEST_CACHE")
    d = pathlib.Path(keep) if keep else tmp_path_factory.mktemp("cache")
    os.environ["DS_TWOCIRCUIT_CACHE"] = str(d)
    return d


@pytest.fixture(scope="session")
def tiny_model(cache_dir):
    from ds_twocircuit.config import load_config
    from ds_twocircuit.model.tiny import ensure_tiny_model
    run = load_config(str(TINY), [], world_size=8)
    return ensure_tiny_model(run.tc.model.tiny, run.tc.data.eval_size)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# a fail-fast launch's bound: DeepSpeed's launcher alone takes 6-12 s here to start 8 ranks that exit
# at once (2 cores, more under load); a refused config that started a process group, or ranks left
# waiting (they sleep 30 s for the launcher to end them), would take longer
FAIL_FAST_S = 25


_WARM: dict = {}


def _warm_socket() -> str:
    """The session's warm launcher (tests/warm_launch.py), started on the first launch: one
    interpreter imports torch, deepspeed and transformers once and forks each launch's ranks."""
    if not _WARM:
        import atexit
        import signal
        import sys
        import tempfile
        path = os.path.join(tempfile.mkdtemp(prefix="warm"), "sock")
        log = open(os.path.join(os.path.dirname(path), "server.log"), "w")
        proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "warm_launch.py"), "serve", path], cwd=ROOT,
                                env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        atexit.register(lambda: os.killpg(proc.pid, signal.SIGKILL))
        from warm_launch import wait_ready
        wait_ready(proc, path)
        _WARM.update(path=path, proc=proc)
    return _WARM["path"]


def real_launcher() -> bool:
    """DS_TWOCIRCUIT_TEST_LAUNCHER=deepspeed: every launch through DeepSpeed's own launcher."""
    return os.environ.get("DS_TWOCIRCUIT_TEST_LAUNCHER", "warm") == "deepspeed"


def ds_cmd(nprocs: int, script, *args, real: bool = False) -> list[str]:
    """`deepspeed --num_gpus N --master_port P script args...`, through the warm launcher unless
    `real` (the launcher itself under test) or DS_TWOCIRCUIT_TEST_LAUNCHER=deepspeed."""
    if real or real_launcher():
        head = [shutil.which("deepspeed") or "deepspeed"]
    else:
        import sys
        head = [sys.executable, str(ROOT / "tests" / "warm_launch.py"), "run", _warm_socket()]
    return [*head, "--num_gpus", str(nprocs), "--master_port", str(free_port()), str(script), *map(str, args)]


def rank_processes(launcher_pid: int) -> dict:
    """Global rank → the process running it, for a launch started with ds_cmd (real or warm)."""
    import psutil
    if _WARM and not real_launcher():
        pid_file = pathlib.Path(f"{_WARM['path']}.{launcher_pid}.pids")
        return {int(r): psutil.Process(pid) for r, pid in json.loads(pid_file.read_text()).items()}
    out = {}
    for p in psutil.Process(launcher_pid).children(recursive=True):   # launch.py passes --local_rank
        try:
            rank = [a for a in p.cmdline() if a.startswith("--local_rank=")]
            if rank:
                out[int(rank[0].split("=")[1])] = p
        except psutil.NoSuchProcess:
            pass
    return out


def launch_cmd(nprocs: int, run_dir, *overrides, config=TINY, resume=False, env=None, real=False):
    cmd = ds_cmd(nprocs, ROOT / "launch" / "train.py", "--ds-config", config, "--run-dir", run_dir,
                 *(["--resume"] if resume else []), *overrides, real=real)
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)   # ours first, the rest kept
    return cmd, {**os.environ, "PYTHONPATH": path, **(env or {})}


def launch(nprocs: int, run_dir, *overrides, config=TINY, resume=False, timeout=300, check=True, env=None,
           real=False):
    """`deepspeed --num_gpus N launch/train.py ...` as a user runs it (warm unless `real`); →
    CompletedProcess."""
    cmd, env = launch_cmd(nprocs, run_dir, *overrides, config=config, resume=resume, env=env, real=real)
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"launch failed ({p.returncode}):\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}")
    return p


def rows(run_dir, name="metrics.jsonl"):
    return [json.loads(l) for l in (pathlib.Path(run_dir) / name).read_text().splitlines() if l.strip()]


def weights(run_dir) -> dict:
    """A run's exported weights, name → tensor."""
    out = {}
    for f in sorted((run_dir / "model").glob("*.safetensors")):
        out.update(load_file(f))
    return out


def assert_same_weights(wa: dict, wb: dict, lr: float = 3e-4, steps: int = 4) -> None:
    """Two runs' weights equal to float summation order: every element within 1e-5 relative plus
    1 % of the most `steps` AdamW steps can move it (0.01·lr·steps, 1.2e-5 at the tests' 4 steps of
    lr 3e-4), with no tensor exempt.

    Why that bound: AdamW normalises each element's step to about lr whatever its gradient's size, so
    a reordered sum's relative error in a gradient reaches the weight as a share of lr, not of the
    weight; where a gradient is mostly cancellation, Adam amplifies float noise furthest. Measured
    (2026-12-06, the six tests that call this): at most 7.8e-7, on the attention key biases'
    slowest rotary pairs (a key bias adds q·b to all of a query's scores, which the softmax ignores
    but for RoPE's rotation of b, nearly nil on those pairs over 12-token rows, so their gradient is
    float noise); 2.3e-6 on another machine earlier, and 1.9e-6 in a down projection on an AVX-512
    Xeon; elsewhere ≤ 3e-7. What it must detect: one element stepped differently, which moves it by
    up to lr (3e-4), or two runs moving apart for one step, 25× the bound."""
    assert wa.keys() == wb.keys()
    for n in wa:
        torch.testing.assert_close(wa[n], wb[n], rtol=1e-5, atol=0.01 * lr * steps, msg=n)


def assert_rows_close(a: list[dict], b: list[dict], keys, rel_tol: float, abs_tol: float = 1e-7) -> None:
    """Two runs' rows step by step: each key within rel_tol (or abs_tol, for values at 0). Each
    caller states why its bound. DS_TWOCIRCUIT_TEST_RECORD=FILE appends the largest relative
    difference seen per key (how the bounds were measured)."""
    assert len(a) == len(b) and a, (len(a), len(b))
    missing = [k for k in keys if not any(k in r for r in a + b)]
    assert not missing, f"keys logged by neither run: {missing}"
    worst = {}
    for ra, rb in zip(a, b):
        for k in keys:
            if k in ra or k in rb:     # on the steps that log it (probe keys), in both runs
                assert math.isclose(ra[k], rb[k], rel_tol=rel_tol, abs_tol=abs_tol), (ra["step"], k, ra[k], rb[k])
                if max(abs(ra[k]), abs(rb[k])) > 100 * abs_tol:    # not float noise around 0
                    worst[k] = max(worst.get(k, 0.0), abs(ra[k] - rb[k]) / abs(ra[k]))
    if os.environ.get("DS_TWOCIRCUIT_TEST_RECORD"):
        import inspect
        with open(os.environ["DS_TWOCIRCUIT_TEST_RECORD"], "a") as f:
            f.write(json.dumps({"test": inspect.stack()[1].function, "worst_rel": worst}) + "\n")


def assert_clipped_norms(r: list[dict], max_norm: float, rel_tol: float = 1e-4) -> None:
    """The norm measured on the gradient the optimizer stepped from is min(pre-clip norm, max_norm),
    and the clip binds on some step. Bound: the clip scales by max_norm/(n + 1e-6), 2e-5 relative at
    n = 0.05, plus float order; a clip that does not scale leaves the measured norm at n."""
    assert any(x["actor/grad_norm"] > 1.1 * max_norm for x in r), [x["actor/grad_norm"] for x in r]
    for x in r:
        want = min(x["actor/grad_norm"], max_norm)
        assert math.isclose(x["actor/grad_norm_clipped"], want, rel_tol=rel_tol), (x["step"], x["actor/grad_norm"],
                                                                              x["actor/grad_norm_clipped"])


def stage_numel(run_dir) -> list[int]:
    """Parameters per stage of a run's export (one shard per stage)."""
    return [sum(t.numel() for t in load_file(str(f)).values())
            for f in sorted((pathlib.Path(run_dir) / "model").glob("model-*-of-*.safetensors"))]


def stages(n_stages: int, n_layers: int = 8) -> str:
    base, extra = divmod(n_layers, n_stages)
    split = [base + (1 if i < extra else 0) for i in range(n_stages)]
    return "model.layers_per_stage=[" + ",".join(map(str, split)) + "]"


@pytest.fixture(scope="session")
def fixtures(tmp_path_factory) -> dict:
    """launch/make_fixtures.py's stand-ins for a user's model and data: a warm-started Qwen2.5-layout
    model with a byte-level BPE tokenizer and chat template, MATH-style rows (about 40 s)."""
    import sys
    sys.path.insert(0, str(ROOT / "launch"))
    from make_fixtures import make_fixtures
    return make_fixtures(tmp_path_factory.mktemp("fixtures"))


@pytest.fixture(scope="session")
def eight(tiny_model, tmp_path_factory):
    """The reference run: 8 stages, dense, 4 GRPO steps of the tiny config."""
    d = tmp_path_factory.mktemp("eight")
    launch(8, d)
    return d


# sync mode, the anchor on (c = K = 2), PRF boundaries, a checkpoint every 3 of 12 steps; the drift
# controller on, reading the probe at steps 1, 5 and 9 (β moves from steps 6 and 10), its dense-step
# rate pinned at 0.4 (dense steps 3, 5, 8 and 10), so a resume must rebuild β and the accumulator;
# a bf16 sampler, so its weight sync and θ to the anchor travel as sparse deltas (a resume must pick
# up the delta chain where the uninterrupted run had it)
ANCHORED = ("codec.name=prf", "anchor.enabled=true", "anchor.mode=sync", "anchor.every=2", "anchor.staleness=2",
            "anchor.timeout=60", "train.steps=12", "train.save_every=3", "train.eval_every=100", "train.probe_every=4",
            "control.enabled=true", "control.dense_rate_min=0.4", "control.dense_rate_max=0.4",
            "sampler.dtype=bfloat16")


@pytest.fixture(scope="session")
def anchored(tiny_model, tmp_path_factory):
    """The two-circuit reference run: 8 ranks on one host, the managed anchor, ANCHORED's config;
    the sampler's weights dumped at its end (sync/weight_sync.py's test hook) into `sampler/`, every
    torch.distributed call recorded (pipeline/comm.py's test hook) into `collectives/`."""
    d = tmp_path_factory.mktemp("anchored")
    launch(8, d, *ANCHORED, env={"DS_TWOCIRCUIT_DUMP_SAMPLER": str(d / "sampler"),
                                 "DS_TWOCIRCUIT_RECORD_COLLECTIVES": str(d / "collectives")})
    return d


def _shape_msg(k: str) -> bool:
    return (k.startswith("codec/") and k.endswith(("bytes_fwd", "bytes_fwd_bf16")) or k == "codec/dense_equiv_bytes"
            or k.startswith("wire/"))


# keys that read the machine (wall clock, memory), not the run's numbers: identity checks skip them
VOLATILE = ("timing/", "anchor/wait", "memory/")


def assert_resumed_rows(full: list[dict], resumed: list[dict], restarts: set[int], volatile=VOLATILE) -> None:
    """A resumed run's rows equal the uninterrupted run's, bit for bit, but for wall-clock keys and,
    at each step a restarted engine ran first (`restarts`), DeepSpeed's shape message: its first
    send carries one (1 KB per cut), which the uninterrupted run sends again only when its padded
    length changes: the senders' counts (codec/*) and the receivers' (wire/*, the boundaries and the
    total; what derives from them, baseline and busiest link, is left unchecked there)."""
    assert [r["step"] for r in resumed] == [r["step"] for r in full]
    for ra, rb in zip(full, resumed):
        a, b = ({k: v for k, v in r.items() if not k.startswith(volatile)} for r in (ra, rb))
        if ra["step"] in restarts:
            extra = {k: b[k] - a[k] for k in a if _shape_msg(k)}
            sent = {k: v for k, v in extra.items() if k.startswith("codec/")}
            assert all(v in (0, 1024 * (7 if "boundary" not in k else 1)) for k, v in sent.items()), sent
            got = {k: v for k, v in extra.items() if k.startswith("wire/boundary_") or k == "wire/total_bytes"}
            assert all(v in (0, 7 * 1024) for v in got.values()) and got["wire/total_bytes"] == 7 * 1024 * any(
                sent.values()), got
            a, b = ({k: v for k, v in x.items() if not _shape_msg(k)} for x in (a, b))
        assert a == b, (ra["step"], {k: (a[k], b.get(k)) for k in a if a[k] != b.get(k)})


def can_make_namespaces() -> str | None:
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if not (shutil.which("ip") and shutil.which("tc")):
        return "needs iproute2 (ip, tc)"
    name = f"tclprobe{os.getpid()}"
    if subprocess.run(["ip", "netns", "add", name], capture_output=True).returncode != 0:
        return "this kernel/sandbox refuses 'ip netns add'"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None
