"""Draw the panels users read a run by, runs overlaid: `python launch/plot_run.py RUN_DIR [RUN_DIR ...] [-o out.png]`.

Reads each run's `metrics.jsonl` and `eval.jsonl` (no DeepSpeed, no torch). Panels: reward (moving
average), held-out accuracy, codec-view entropy and KL to the reference, the train-inference gap on
sampled tokens, clip fraction, the codec-off probe's drift (dense KL to the reference), and where the
learning direction comes from (the probe steps' gradient cosines with the dense gradient), and β of
the KL term (constant unless the drift controller runs), response length and the gradient norm. A
panel whose key a run never logged is left empty for that run. A run directory's `metrics.jsonl` may
be gzipped (`metrics.jsonl.gz`, as the long-run campaign keeps them). Needs matplotlib (`pip install .[plot]`).
"""
import argparse
import gzip
import json
import pathlib

PANELS = [
    ("critic/score/mean", "reward (10-step mean)", 10),
    ("acc", "held-out greedy accuracy", 0),
    ("actor/entropy", "entropy (codec view; dense steps left out)", 1),
    ("actor/kl_loss", "k3 KL to reference (codec view; dense steps left out)", 1),
    ("rollout_corr/kl", "train-inference gap, nats/token (dense steps left out)", 1),
    ("actor/pg_clipfrac", "clip fraction", 1),
    ("probe/actor/kl_loss", "probe: dense KL to reference (true drift)", 0),
    ("grad/cos_corrected_dense", "cos(corrected grad, dense grad)", 0),
    ("actor/kl_coef", "KL coefficient β (the drift controller moves it)", 0),
    ("response_length/mean", "response length, tokens (10-step mean)", 10),
    ("actor/grad_norm", "gradient norm before clipping (10-step mean)", 10),
]


SYMLOG = ("actor/kl_loss", "rollout_corr/kl")
CODEC_VIEW = ("actor/entropy", "actor/kl_loss", "rollout_corr/kl")   # dense steps left out of these


def read_jsonl(path: pathlib.Path) -> list[dict]:
    """The rows of `path`, or of `path`.gz; none if neither exists."""
    gz = path.with_name(path.name + ".gz")
    if not path.is_file() and gz.is_file():
        return [json.loads(line) for line in gzip.open(gz, "rt") if line.strip()]
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def series(rows: list[dict], key: str) -> tuple[list, list]:
    pts = [(r["step"], r[key]) for r in rows if key in r and r[key] is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def panel_series(metrics: list[dict], evals: list[dict], key: str) -> tuple[list, list]:
    """One panel's points of one run; the codec-view panels leave dense steps out (their values are
    the dense model's, not the codec's)."""
    if key == "acc":
        return series(evals, key)
    return series([r for r in metrics if not (key in CODEC_VIEW and r.get("train/dense_step"))], key)


def scale(key: str, ys: list[float]) -> str:
    """The y scale of a panel from all runs' values: log for β, symlog where a dense run's ~0 sits
    beside a codec's several nats, linear otherwise."""
    ys = [abs(v) for v in ys if v == v]   # NaN-free
    if key == "actor/kl_coef" and ys and min(ys) > 0:
        return "log"
    if key in SYMLOG and ys and min(ys) < 1e-2 and max(ys) > 1:
        return "symlog"
    return "linear"


def smooth(y: list[float], w: int) -> list[float]:
    if w <= 1:
        return y
    return [sum(y[max(0, i - w + 1):i + 1]) / len(y[max(0, i - w + 1):i + 1]) for i in range(len(y))]


def plot(run_dirs: list[pathlib.Path], out: pathlib.Path, labels: list[str] | None = None) -> pathlib.Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(3, 4, figsize=(19, 11))
    spread: dict[str, list[float]] = {}
    for i, d in enumerate(run_dirs):
        label = labels[i] if labels else d.name
        metrics, evals = read_jsonl(d / "metrics.jsonl"), read_jsonl(d / "eval.jsonl")
        for ax, (key, title, w) in zip(axes.flat, PANELS):
            x, y = panel_series(metrics, evals, key)
            if x:
                ax.plot(x, smooth(y, w), marker="o" if key in ("acc",) or key.startswith(("probe/", "grad/")) else None,
                        ms=3, lw=1.3, label=label, color=f"C{i}")
            spread[key] = spread.get(key, []) + y
            ax.set_title(title, fontsize=10)
            ax.set_xlabel("step", fontsize=8)
            ax.tick_params(labelsize=8)
            ax.grid(alpha=0.3)
    for ax in axes.flat[len(PANELS):]:
        ax.set_visible(False)
    for ax, (key, _, _) in zip(axes.flat, PANELS):
        how = scale(key, spread.get(key, []))
        ax.set_yscale(how, **({"linthresh": 1e-3} if how == "symlog" else {}))
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", type=pathlib.Path)
    p.add_argument("-o", "--out", type=pathlib.Path, default=pathlib.Path("runs/plot.png"))
    p.add_argument("--labels", default=None, help="comma-separated legend labels, one per run")
    args = p.parse_args(argv)
    missing = [str(d) for d in args.runs if not read_jsonl(d / "metrics.jsonl")]
    if missing:
        p.error(f"no metrics.jsonl in {', '.join(missing)}: pass run directories (launch/train.py --run-dir)")
    print(plot(args.runs, args.out, args.labels.split(",") if args.labels else None))


if __name__ == "__main__":
    main()
