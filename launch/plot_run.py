"""Draw the panels users read a run by, runs overlaid: `python launch/plot_run.py RUN_DIR [RUN_DIR ...] [-o out.png]`.

Reads each run's `metrics.jsonl` and `eval.jsonl` (no DeepSpeed, no torch). Panels: reward (moving
average), held-out accuracy, codec-view entropy and KL to the reference, the train-inference gap on
sampled tokens, clip fraction, the codec-off probe's drift (dense KL to the reference), and where the
learning direction comes from (the probe steps' gradient cosines with the dense gradient), and β of
the KL term (constant unless the drift controller runs), response length and the gradient norm.
Every panel's y-axis names its units; one legend for all panels sits in the grid's spare cell. The
codec-view panels (entropy, KL to the reference, the gap) say on the figure that they are the
compressed pipeline's reading, high by construction, and that the true drift is the probe panel.
A panel whose key a run never logged is left empty for that run. A run directory's `metrics.jsonl`
may be gzipped (`metrics.jsonl.gz`, as the long-run campaign keeps them). matplotlib is a dependency
of the package; where it does not import, the script says what to install and exits with status 1.
"""
import argparse
import gzip
import json
import pathlib
import sys

PANELS = [   # key, title, y-axis label with units, moving-average window
    ("critic/score/mean", "reward (10-step mean)", "verifier reward, batch mean", 10),
    ("acc", "held-out greedy accuracy", "accuracy (fraction correct)", 0),
    ("actor/entropy", "entropy (dense steps left out)", "entropy, nats/token", 1),
    ("actor/kl_loss", "k3 KL to reference (dense steps left out)", "k3 KL, nats/token", 1),
    ("rollout_corr/kl", "train-inference gap (dense steps left out)", "k1 KL on sampled tokens, nats/token", 1),
    ("actor/pg_clipfrac", "clip fraction", "fraction of tokens clipped", 1),
    ("probe/actor/kl_loss", "probe, codec off: dense KL to reference (TRUE drift)", "k3 KL, nats/token", 0),
    ("grad/cos_corrected_dense", "cos(corrected grad, dense grad)", "cosine", 0),
    ("actor/kl_coef", "KL coefficient β (the drift controller moves it)", "β (dimensionless)", 0),
    ("response_length/mean", "response length (10-step mean)", "tokens", 10),
    ("actor/grad_norm", "gradient norm before clipping (10-step mean)", "global L2 norm", 10),
]

# A compressed recipe's codec-view values (gap ~3 nats/token, KL 1-20) read as "broken" to a verl
# user; the figure itself must say whose view they are and where the true drift is.
CODEC_NOTE = "CODEC VIEW, not the true drift (see probe panel)"
FIGURE_NOTE = ("Panels titled in red are the compressed pipeline's codec view (read through the boundary codec): "
               "for a compressed recipe they sit high from step 1 by construction (gap ~3 nats/token, KL 1-20).\n"
               "The true drift of the model is the probe panel: dense KL to the reference with the codec off.")

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


def pyplot():
    """pyplot on the file-only Agg backend: training machines have no display."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def draw_run(axes, metrics: list[dict], evals: list[dict], label: str, color: str, spread: dict) -> None:
    """One run's curves on every panel; its raw values join `spread`, which picks the scales."""
    for ax, (key, _, _, w) in zip(axes, PANELS):
        x, y = panel_series(metrics, evals, key)
        if x:
            ax.plot(x, smooth(y, w), marker="o" if key == "acc" or key.startswith(("probe/", "grad/")) else None,
                    ms=3, lw=1.3, label=label, color=color)
        spread[key] = spread.get(key, []) + y


def dress(ax, key: str, title: str, ylabel: str, ys: list[float]) -> None:
    """Title, units and scale of one panel; a codec-view panel's title says whose view it is."""
    codec = key in CODEC_VIEW
    ax.set_title(f"{title}\n{CODEC_NOTE}" if codec else title, fontsize=10, color="firebrick" if codec else "black")
    ax.set_ylabel(ylabel, fontsize=9)
    ax.set_xlabel("step", fontsize=8)
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3)
    how = scale(key, ys)
    ax.set_yscale(how, **({"linthresh": 1e-3} if how == "symlog" else {}))


def legend_cell(ax, labels: list[str]) -> None:
    """The grid's spare cell holds the one legend of every panel, where no curve can hide it."""
    from matplotlib.lines import Line2D
    ax.axis("off")
    handles = [Line2D([], [], color=f"C{i}", lw=2, label=lab) for i, lab in enumerate(labels)]
    ax.legend(handles=handles, loc="center", fontsize=11, title="runs", title_fontsize=11)


def figure(run_dirs: list[pathlib.Path], labels: list[str] | None = None):
    """Every panel, the runs overlaid, the legend and the figure's note on the codec view."""
    plt = pyplot()
    labels = labels or [d.name for d in run_dirs]
    nrows = -(-(len(PANELS) + 1) // 4)   # always one cell spare, for the legend
    fig, axes = plt.subplots(nrows, 4, figsize=(19, 3.7 * nrows + 0.6), layout="constrained")
    axes = list(axes.flat)
    spread: dict[str, list[float]] = {}
    for i, d in enumerate(run_dirs):
        draw_run(axes, read_jsonl(d / "metrics.jsonl"), read_jsonl(d / "eval.jsonl"), labels[i], f"C{i}", spread)
    for ax, (key, title, ylabel, _) in zip(axes, PANELS):
        dress(ax, key, title, ylabel, spread.get(key, []))
    legend_cell(axes[len(PANELS)], labels)
    for ax in axes[len(PANELS) + 1:]:
        ax.set_visible(False)
    fig.suptitle(FIGURE_NOTE, fontsize=11, color="firebrick")
    return fig


def plot(run_dirs: list[pathlib.Path], out: pathlib.Path, labels: list[str] | None = None) -> pathlib.Path:
    fig = figure(run_dirs, labels)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    pyplot().close(fig)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", type=pathlib.Path)
    p.add_argument("-o", "--out", type=pathlib.Path, default=pathlib.Path("runs/plot.png"))
    p.add_argument("--labels", default=None, help="comma-separated legend labels, one per run")
    args = p.parse_args(argv)
    try:
        pyplot()
    except ImportError as e:   # a broken env: one line saying what to install, not a traceback
        sys.exit(f"plot_run.py: matplotlib does not import ({(str(e).splitlines() or [type(e).__name__])[0]}); "
                 "install it: pip install 'matplotlib>=3.8'")
    missing = [str(d) for d in args.runs if not read_jsonl(d / "metrics.jsonl")]
    if missing:
        p.error(f"no metrics.jsonl in {', '.join(missing)}: pass run directories (launch/train.py --run-dir)")
    print(plot(args.runs, args.out, args.labels.split(",") if args.labels else None))


if __name__ == "__main__":
    main()
