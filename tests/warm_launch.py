"""A warm stand-in for `deepspeed --num_gpus N script ...` on one host, for the test suite.

A real launch here pays ~30 s before its first step: DeepSpeed's runner and launch.py import torch
and deepspeed, then 8 ranks each import torch, deepspeed and transformers on 2 cores. The suite
starts ~50 launches, so half its time was start-up. Here one server process imports all of that
once per test session; each launch is a fork of it per rank, with the environment DeepSpeed's
launch.py gives a rank (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_SIZE, CROSS_RANK, CROSS_SIZE,
MASTER_ADDR, MASTER_PORT, CUDA_VISIBLE_DEVICES, `--local_rank=i` before the script's arguments) and
the script run as `__main__`, the same entry point a user's launch runs.

    python tests/warm_launch.py serve SOCKET             # imports once, then forks per request
    python tests/warm_launch.py run SOCKET --num_gpus N [--master_port P] SCRIPT ARGS...

`run` is a light client (no torch): it hands the server its environment, working directory and its
stdin/stdout/stderr (SCM_RIGHTS), so the ranks print where a real launch's would and
`subprocess.run` captures them as it would. It exits with the launch's code. As DeepSpeed's
launch.py does, the first rank to exit non-zero has the others' process trees terminated (SIGTERM,
SIGKILL after 30 s) and its code becomes the launch's. When the client dies (a test killed it, or
timed out), the server kills the launch's ranks and everything they started. The ranks' pids are
written to `<SOCKET>.<client pid>.pids` (JSON, global rank → pid) for the tests that kill or hold
one rank.

Where the launcher itself is under test (config errors through `deepspeed`, multi-host, the
README's main command), the tests use DeepSpeed's real launcher; `DS_TWOCIRCUIT_TEST_LAUNCHER=
deepspeed` makes every launch real (conftest.py).
"""
import json
import os
import select
import signal
import socket
import struct
import sys
import time

# what a rank imports before its first step (~10 s of CPU each, 8 ranks on 2 cores)
PRELOAD = ("torch", "deepspeed", "deepspeed.pipe", "transformers", "transformers.models.qwen2.modeling_qwen2",
           "safetensors.torch", "omegaconf", "ds_twocircuit.trainer", "ds_twocircuit.model.weights")


def _send(sock: socket.socket, obj, fds=()) -> None:
    data = json.dumps(obj).encode()
    msg = struct.pack("!I", len(data)) + data
    socket.send_fds(sock, [msg], list(fds)) if fds else sock.sendall(msg)


def _recv(sock: socket.socket, with_fds: int = 0):
    """One length-prefixed JSON message (and up to `with_fds` descriptors with its first bytes)."""
    head, fds, _, _ = socket.recv_fds(sock, 4, with_fds) if with_fds else (sock.recv(4), [], 0, None)
    if len(head) < 4:
        return None, fds
    n, data = struct.unpack("!I", head)[0], b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            return None, fds
        data += chunk
    return json.loads(data), fds


# ---- the server -----------------------------------------------------------------------------------

def serve(path: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for mod in PRELOAD:
        __import__(mod)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(16)
    print("ready", flush=True)
    while True:
        ready, _, _ = select.select([srv], [], [], 1.0)
        while True:   # reap finished supervisors
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break
        if not ready:
            continue
        conn, _ = srv.accept()
        if os.fork() == 0:
            srv.close()
            try:
                code = supervise(conn)
            except BaseException:   # noqa: BLE001  (a supervisor must never return into the loop)
                import traceback
                traceback.print_exc()
                code = 1
            os._exit(code)
        conn.close()


def supervise(conn: socket.socket) -> int:
    """One launch: fork its ranks, watch them and the client, report the launch's exit code."""
    req, fds = _recv(conn, with_fds=3)
    if req is None:
        return 1
    ranks = {}
    for local in range(req["nprocs"]):
        pid = os.fork()
        if pid == 0:
            conn.close()
            _run_rank(req, local, fds)
        ranks[local] = pid
    for fd in fds:
        os.close(fd)
    _send(conn, {"pids": ranks})
    code = _watch(conn, ranks)
    try:
        _send(conn, {"code": code})
    except OSError:
        pass
    return 0


def _run_rank(req: dict, local: int, fds) -> None:
    """In the forked rank: become what DeepSpeed's launch.py starts, run the script, never return."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in fds:
        os.close(fd)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _fresh_interpreter_state()
    n = req["nprocs"]
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    os.environ.update({"MASTER_ADDR": req["master_addr"], "MASTER_PORT": str(req["master_port"]),
                       "WORLD_SIZE": str(n), "CROSS_RANK": "0", "CROSS_SIZE": "1", "LOCAL_SIZE": str(n),
                       "CUDA_VISIBLE_DEVICES": ",".join(map(str, range(n))),
                       "RANK": str(local), "LOCAL_RANK": str(local), "PYTHONUNBUFFERED": "1"})
    script = os.path.abspath(req["script"])
    sys.argv = [script, f"--local_rank={local}", *req["args"]]
    sys.path[0] = os.path.dirname(script)
    for p in reversed(req["env"].get("PYTHONPATH", "").split(os.pathsep)):
        if p and p not in sys.path:
            sys.path.insert(1, p)
    code = 0
    try:
        import runpy
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:   # noqa: BLE001  (a rank's uncaught error, printed as Python would)
        import traceback
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _fresh_interpreter_state() -> None:
    """What a new interpreter would not share with its siblings: unbuffered stdio (launch.py runs
    `python -u`), and Python's and numpy's global generators reseeded from the OS. (The string hash
    seed cannot change after start: the ranks share the server's.)"""
    import io
    import random
    sys.stdout = io.TextIOWrapper(open(1, "wb", buffering=0, closefd=False), write_through=True)
    sys.stderr = io.TextIOWrapper(open(2, "wb", buffering=0, closefd=False), write_through=True)
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()


def _watch(conn: socket.socket, ranks: dict[int, int]) -> int:
    """Wait for the ranks as DeepSpeed's launch.py does; the client's hang-up kills the launch."""
    alive = set(ranks.values())
    while alive:
        for pid in list(alive):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                alive.discard(pid)
                code = os.waitstatus_to_exitcode(status)
                if code != 0:
                    _terminate(alive, grace=30)
                    return code
        readable, _, _ = select.select([conn], [], [], 0.1)
        if readable and not conn.recv(1):   # the client is gone
            _terminate(alive, grace=0)
            return 1
    return 0


def _terminate(pids, grace: float) -> None:
    """Each rank's process tree: SIGTERM, then SIGKILL what is left after `grace` seconds."""
    import psutil
    procs = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            procs += p.children(recursive=True) + [p]
        except psutil.NoSuchProcess:
            pass
    for p in procs:
        try:
            p.kill() if grace == 0 else p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace or 5)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    for pid in pids:
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass


# ---- the client ---------------------------------------------------------------------------------

def run(path: str, argv: list[str]) -> int:
    import argparse
    p = argparse.ArgumentParser(prog="warm_launch.py run")
    p.add_argument("--num_gpus", type=int, required=True)
    p.add_argument("--master_port", type=int, default=29500)
    p.add_argument("--master_addr", default="127.0.0.1")
    p.add_argument("script")
    p.add_argument("args", nargs="...")
    a = p.parse_args(argv)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    _send(sock, {"nprocs": a.num_gpus, "master_port": a.master_port, "master_addr": a.master_addr,
                 "script": a.script, "args": a.args, "env": dict(os.environ), "cwd": os.getcwd()},
          fds=[0, 1, 2])
    # a SIGTERM/SIGINT ends the client; the server sees the hang-up and ends the ranks
    signal.signal(signal.SIGTERM, lambda *_: os._exit(1))
    msg, _ = _recv(sock)
    if msg is None:
        return 1
    pid_file = f"{path}.{os.getpid()}.pids"
    with open(pid_file + ".tmp", "w") as f:
        json.dump(msg["pids"], f)
    os.replace(pid_file + ".tmp", pid_file)
    try:
        msg, _ = _recv(sock)
    except KeyboardInterrupt:
        return 1
    finally:
        os.remove(pid_file)
    return 1 if msg is None else msg["code"]


def wait_ready(proc, path: str, timeout: float = 300) -> None:
    """Block until the server at `path` accepts (it prints 'ready' once its imports are done)."""
    deadline = time.time() + timeout
    while not os.path.exists(path):
        if proc.poll() is not None or time.time() > deadline:
            raise RuntimeError(f"the warm launcher did not start (exit {proc.poll()})")
        time.sleep(0.1)


if __name__ == "__main__":
    verb, sock_path = sys.argv[1], sys.argv[2]
    if verb == "serve":
        serve(sock_path)
    else:
        sys.exit(run(sock_path, sys.argv[3:]))
