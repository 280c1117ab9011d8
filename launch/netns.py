"""Hosts on one machine: network namespaces on a bridge, each with its own address and link.

Used by bench_links.py (one namespace per stage, rate-limited with Linux `tc` token-bucket shaping)
and multihost.py (one per host, DeepSpeed's multi-node launcher across them). Needs root and
iproute2; the context manager removes every namespace, veth pair and the bridge it made, on exit,
error or Ctrl-C.
"""
import pathlib
import subprocess

SUBNET = "10.231.137"


def sh(*cmd: str, check: bool = True) -> str:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {p.stderr.strip()}")
    return p.stdout


class Namespaces:
    """n namespaces `<prefix>n<i>` on bridge `<prefix>br`; peer `<prefix>p<i>` inside, `<prefix>v<i>` outside."""

    def __init__(self, n: int, prefix: str, subnet: str = SUBNET):
        self.n, self.prefix, self.subnet = n, prefix, subnet
        self.ns = [f"{prefix}n{i}" for i in range(n)]
        self.bridge = f"{prefix}br"

    def addr(self, i: int) -> str:
        return f"{self.subnet}.{i + 1}"

    def peer(self, i: int) -> str:
        return f"{self.prefix}p{i}"

    def __enter__(self):
        try:
            sh("ip", "link", "add", self.bridge, "type", "bridge")
            sh("ip", "link", "set", self.bridge, "up")
            for i, ns in enumerate(self.ns):
                v, p = f"{self.prefix}v{i}", self.peer(i)
                sh("ip", "netns", "add", ns)
                sh("ip", "link", "add", v, "type", "veth", "peer", "name", p)
                sh("ip", "link", "set", p, "netns", ns)
                sh("ip", "link", "set", v, "master", self.bridge)
                sh("ip", "link", "set", v, "up")
                sh("ip", "-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", p)
                sh("ip", "-n", ns, "link", "set", p, "up")
                sh("ip", "-n", ns, "link", "set", "lo", "up")
        except Exception:
            self.cleanup()
            raise
        return self

    def __exit__(self, *exc):
        self.cleanup()

    def cleanup(self) -> None:
        for ns in self.ns:
            sh("ip", "netns", "del", ns, check=False)   # takes its veth pair with it
        sh("ip", "link", "del", self.bridge, check=False)

    def shape(self, rate: str | None) -> None:
        """tbf on every stage's egress; None removes it (unshaped)."""
        for i, ns in enumerate(self.ns):
            sh("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", self.peer(i), "root", check=False)
            if rate:
                bps = parse_rate(rate)
                burst = max(16 * 1024, int(bps / 8 / 250))      # ≥ one timer tick of traffic
                sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", self.peer(i), "root", "tbf",
                   "rate", rate, "burst", str(burst), "latency", "2s")

    def tx_bytes(self) -> list[int]:
        """Bytes each namespace has sent (the outside end's receive counter)."""
        return [int(pathlib.Path(f"/sys/class/net/{self.prefix}v{i}/statistics/rx_bytes").read_text())
                for i in range(self.n)]


def parse_rate(rate: str) -> float:
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for u, m in units.items():
        if rate.endswith(u):
            return float(rate[: -len(u)]) * m
    raise ValueError(f"rate '{rate}': use e.g. 100mbit, 1gbit")
