"""launch/train.py across hosts, with DeepSpeed's own multi-node launcher, on hosts made on this machine.

    sudo python launch/multihost.py [--nodes 2] [--slots 4] [--anchor-host] [--rate 100mbit] --run-dir DIR \
        -- --ds-config ds_configs/prf95.json [key=value ...]

Each host is a network namespace on one bridge (netns.py) with its own address; a hostfile names
them (`host0 slots=4`, ...). On every host this runs what a cluster user runs on each node when
the nodes have no ssh between them:

    deepspeed --hostfile HOSTFILE --no_ssh --node_rank I --master_addr <host0's address> \
        --master_port P launch/train.py --ds-config ... --run-dir DIR [key=value ...]

so global ranks, their placement and the rendezvous come from DeepSpeed's launcher (8 stages over
2 hosts × 4 ranks: stages 0–3 on host0, 4–7 on host1, every cut between them crosses the bridge).
`--anchor-host` adds one more host that runs the dense anchor (`anchor.external=true`, set here)
on the run's mailbox, which the hosts share as a directory (on a cluster: a shared filesystem, or
any file transport that carries it both ways). `--rate` caps every host's egress (tc's token
bucket, as bench_links.py shapes its stages): with `--nodes 8 --slots 1` every cut between stages,
and every collective, runs over a link of that rate. Every namespace, link, hostfile and process it made
is removed when it ends, also on failure. Exits with the first non-zero status of a host.
"""
import argparse
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from netns import Namespaces  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
SUBNET = "10.231.138"


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=2, help="hosts that run trainer ranks")
    p.add_argument("--slots", type=int, default=4, help="ranks per host")
    p.add_argument("--anchor-host", action="store_true", help="one more host runs the anchor (anchor.external)")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--master-port", type=int, default=29511)
    p.add_argument("--rate", help="every host's egress rate (tc units: 10mbit, 1gbit); default unshaped")
    p.add_argument("--timeout", type=float, default=1800, help="seconds before every host is stopped")
    p.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then launch/train.py's arguments")
    a = p.parse_args(argv)
    a.train_args = a.train_args[1:] if a.train_args[:1] == ["--"] else a.train_args
    if os.geteuid() != 0 or not shutil.which("ip"):
        p.error("needs root and iproute2 (network namespaces)")
    return a


def host_cmds(a, net: Namespaces, hostfile: pathlib.Path) -> list[list[str]]:
    """The command each host runs, in namespace order; the anchor's last."""
    deepspeed = shutil.which("deepspeed") or str(pathlib.Path(sys.executable).with_name("deepspeed"))
    train = [str(ROOT / "launch" / "train.py"), *a.train_args, "--run-dir", a.run_dir,
             *(["anchor.external=true"] if a.anchor_host else [])]
    cmds = [[deepspeed, "--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(i), "--master_addr", net.addr(0),
             "--master_port", str(a.master_port), *train] for i in range(a.nodes)]
    if a.anchor_host:
        cmds.append([sys.executable, str(ROOT / "launch" / "anchor.py"), "--mailbox", str(pathlib.Path(a.run_dir) / "anchor")])
    return cmds


def run(a) -> int:
    prefix = f"tcm{os.getpid() % 100000}"
    procs = []
    with tempfile.TemporaryDirectory() as tmp, Namespaces(a.nodes + int(a.anchor_host), prefix, SUBNET) as net:
        net.shape(a.rate)
        hostfile = pathlib.Path(tmp) / "hostfile"
        hostfile.write_text("".join(f"host{i} slots={a.slots}\n" for i in range(a.nodes)))
        print(f"[multihost] hostfile:\n{hostfile.read_text()}", end="", flush=True)
        try:
            for i, cmd in enumerate(host_cmds(a, net, hostfile)):
                # gloo binds to the host's own link; the launcher passes the environment to its ranks
                env = {**os.environ, "GLOO_SOCKET_IFNAME": net.peer(i), "PYTHONPATH": str(ROOT)}
                print(f"[multihost] {net.ns[i]} ({net.addr(i)}): {' '.join(cmd)}", flush=True)
                procs.append(subprocess.Popen(["ip", "netns", "exec", net.ns[i], *cmd], env=env, cwd=ROOT,
                                              start_new_session=True))
            return wait_all(procs[:a.nodes], a.timeout, anchor=procs[a.nodes] if a.anchor_host else None)
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, 9)
                    p.wait()


def wait_all(hosts, timeout: float, anchor=None) -> int:
    """The hosts' first non-zero status (the others are stopped then), else 0 once all are done and
    the anchor host has seen the trainer's STOP."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        codes = [p.poll() for p in hosts]
        bad = [c for c in codes if c not in (None, 0)]
        if bad:
            print(f"[multihost] a host exited with {bad[0]}: stopping the others", file=sys.stderr, flush=True)
            return bad[0]
        if all(c == 0 for c in codes):
            if anchor is not None:
                anchor.wait(timeout=60)
            return 0
        time.sleep(0.2)
    print(f"[multihost] still running after {timeout:.0f} s: stopping every host", file=sys.stderr, flush=True)
    return 124


def main(argv=None) -> None:
    sys.exit(run(parse(argv)))


if __name__ == "__main__":
    main()
