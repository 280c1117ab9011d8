"""launch/plot_run.py draws every panel from the JSONL files alone (no torch, no DeepSpeed)."""
import json
import subprocess
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "launch"))
import plot_run  # noqa: E402


def fake_run(d, gap, probe_every=5, dense_every=0):
    """30 steps; with dense_every, every such step is a dense one whose gap is the backend's (~0)."""
    d.mkdir()
    with open(d / "metrics.jsonl", "w") as f:
        for t in range(1, 31):
            dense = bool(dense_every) and t % dense_every == 0
            row = {"step": t, "critic/score/mean": 0.3, "actor/entropy": 1.0, "actor/kl_loss": 0.1 * t,
                   "rollout_corr/kl": 1e-8 if dense else gap + 0.01 * t, "actor/pg_clipfrac": 0.01,
                   "actor/kl_coef": 0.001 * t, "train/dense_step": float(dense)}
            if t % probe_every == 1:
                row.update({"probe/actor/kl_loss": 0.01 * t, "grad/cos_corrected_dense": 0.1})
            f.write(json.dumps(row) + "\n")
    (d / "eval.jsonl").write_text("".join(json.dumps({"step": s, "acc": 0.3 + s / 100}) + "\n" for s in (0, 10, 20, 30)))
    return d


def test_plot_overlays_runs_into_a_png(tmp_path):
    runs = [fake_run(tmp_path / "dense", 0.0), fake_run(tmp_path / "prf", 3.0, dense_every=7)]
    out = plot_run.plot(runs, tmp_path / "out.png", ["dense", "prf"])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000


def test_a_gzipped_metrics_file_is_read(tmp_path):
    import gzip
    d = fake_run(tmp_path / "run", 0.0)
    rows = plot_run.read_jsonl(d / "metrics.jsonl")
    with gzip.open(d / "metrics.jsonl.gz", "wt") as f:
        f.write((d / "metrics.jsonl").read_text())
    (d / "metrics.jsonl").unlink()
    assert plot_run.read_jsonl(d / "metrics.jsonl") == rows and len(rows) == 30


def test_panels_leave_dense_steps_out_of_codec_views_and_pick_scales(tmp_path):
    m = plot_run.read_jsonl(fake_run(tmp_path / "prf", 3.0, dense_every=7) / "metrics.jsonl")
    x, y = plot_run.panel_series(m, [], "rollout_corr/kl")
    assert 7 not in x and 14 not in x and len(x) == 26 and min(y) > 3.0
    assert len(plot_run.panel_series(m, [], "critic/score/mean")[0]) == 30          # not a codec view
    assert plot_run.panel_series(m, [], "probe/actor/kl_loss")[0] == [1, 6, 11, 16, 21, 26]
    assert plot_run.scale("rollout_corr/kl", [1e-8, 3.0]) == "symlog"              # dense beside prf
    assert plot_run.scale("rollout_corr/kl", [2.6, 4.0]) == "linear"
    assert plot_run.scale("actor/kl_coef", [0.001, 1.0]) == "log"
    assert plot_run.scale("actor/kl_coef", [0.0, 0.001]) == "linear"                 # β = 0 stays visible


def test_a_directory_without_metrics_is_an_error(tmp_path, capsys):
    with pytest.raises(SystemExit):
        plot_run.main([str(tmp_path), "-o", str(tmp_path / "x.png")])
    assert "no metrics.jsonl in" in capsys.readouterr().err


def test_every_panel_has_units_one_legend_and_the_codec_views_say_so(tmp_path):
    runs = [fake_run(tmp_path / "dense", 0.0), fake_run(tmp_path / "prf", 3.0, dense_every=7)]
    fig = plot_run.figure(runs, ["dense", "prf"])
    panels = list(zip(fig.axes, plot_run.PANELS))
    assert sum(any(len(ln.get_xdata()) for ln in ax.lines) for ax, _ in panels) == 9      # two keys never logged
    for ax, (key, *_) in panels:
        assert ax.get_ylabel().strip(), key                                              # units, data or not
        words = ax.get_title() + " ".join(t.get_text() for t in ax.texts)
        assert (plot_run.CODEC_NOTE in words) == (key in plot_run.CODEC_VIEW), key
    legends = [ax.get_legend() for ax in fig.axes if ax.get_legend()] + fig.legends
    assert [[t.get_text() for t in lg.get_texts()] for lg in legends] == [["dense", "prf"]]
    host = legends[0].axes                       # one legend for all panels, not the first panel's
    assert host is None or (host.get_visible() and not host.lines)
    assert "probe panel" in fig.get_suptitle() and "codec" in fig.get_suptitle()
    plot_run.pyplot().close(fig)


def test_without_matplotlib_one_line_and_status_1(tmp_path):
    code = ("import sys; sys.modules['matplotlib'] = None; sys.path.insert(0, 'launch'); import plot_run; "
            f"plot_run.main([{str(tmp_path)!r}])")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and r.stdout == ""
    assert len(r.stderr.splitlines()) == 1 and "pip install 'matplotlib>=3.8'" in r.stderr, r.stderr
