"""The learning table of the anchor search: `python notebooks/search/table.py [--anchor] RUN_DIR[=LABEL] ...`.

Per run: held-out greedy accuracy at every evaluation, the mean reward of the first and last 10
steps, the gradient cosines on probe steps (where the direction comes from), the anchor's traffic per
fire against the dense gradient's size, and seconds per step. Reads metrics.jsonl / eval.jsonl only.
`--anchor` prints the anchor's side instead: the held sign's age, the anchor link's bytes per step
and the sequences the anchor replayed per step (its compute, read off anchor.log).
"""
import json
import pathlib
import re
import statistics
import sys


def rows(path: pathlib.Path) -> list[dict]:
    return [json.loads(l) for l in path.read_text().splitlines() if l.strip()] if path.is_file() else []


def mean(xs):
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else float("nan")


def summarize(run: pathlib.Path) -> dict:
    m, e = rows(run / "metrics.jsonl"), rows(run / "eval.jsonl")
    fires = [r for r in m if r.get("anchor/bytes_down", 0) > 0]
    cfg = run / "anchor" / "config.json"
    out = {
        "acc": [r["acc"] for r in e],
        "reward_first10": mean([r["critic/score/mean"] for r in m[:10]]),
        "reward_last10": mean([r["critic/score/mean"] for r in m[-10:]]),
        "cos_comp": mean([r.get("grad/cos_comp_dense") for r in m[1:]]),
        "cos_corr": mean([r.get("grad/cos_corrected_dense") for r in m[1:]]),
        "agree": mean([r.get("anchor/sign_agreement") for r in m]),
        "s_per_step": mean([r["timing/step"] for r in m[1:]]),
        "up_per_fire": mean([r["anchor/bytes_up"] for r in m if r.get("anchor/bytes_up", 0) > 0]),
        "down_per_fire": mean([r["anchor/bytes_down"] for r in fires]),
        "has_anchor": cfg.is_file(),
    }
    return out


def anchor_table(args: list[str]) -> None:
    print("| run | held-out acc (steps 0, 20, …, 100) | Δ end | anchor/age mean / max | anchor link MB per step "
          "(up / down) | sequences replayed per step |")
    print("|---|---|---|---|---|---|")
    for a in args:
        path, _, label = a.partition("=")
        run = pathlib.Path(path)
        m, acc = rows(run / "metrics.jsonl"), [r["acc"] for r in rows(run / "eval.jsonl")]
        ages = [r["anchor/age"] for r in m if "anchor/age" in r]
        log = (run / "anchor" / "anchor.log").read_text() if (run / "anchor" / "anchor.log").is_file() else ""
        replayed = sum(int(n) for n in re.findall(r"on (\d+) sequences", log))
        side = (f"{mean(ages):.1f} / {max(ages):.0f} | {mean([r['anchor/bytes_up'] for r in m]) / 1e6:.2f} / "
                f"{mean([r['anchor/bytes_down'] for r in m]) / 1e6:.3f} | {replayed / len(m):.0f}") if ages else "– | – | 0"
        print(f"| {label or path} | {' / '.join(f'{x:.3f}' for x in acc)} | {acc[-1] - acc[0]:+.3f} | {side} |")


def main(args: list[str]) -> None:
    if args and args[0] == "--anchor":
        return anchor_table(args[1:])
    print("| run | held-out acc (steps 0, 20, …, 100) | Δ end | reward first/last 10 | cos(G_comp, G_dense) "
          "| cos(G_corr, G_dense) | sign agreement | s/step |")
    print("|---|---|---|---|---|---|---|---|")
    for a in args:
        path, _, label = a.partition("=")
        s = summarize(pathlib.Path(path))
        acc = s["acc"]
        d = acc[-1] - acc[0] if len(acc) > 1 else float("nan")
        print(f"| {label or path} | {' / '.join(f'{x:.3f}' for x in acc)} | {d:+.3f} | "
              f"{s['reward_first10']:.3f} / {s['reward_last10']:.3f} | {s['cos_comp']:.3f} | {s['cos_corr']:.3f} | "
              f"{s['agree']:.3f} | {s['s_per_step']:.2f} |")
    for a in args:
        path, _, label = a.partition("=")
        s = summarize(pathlib.Path(path))
        if s["has_anchor"]:
            print(f"{label or path}: anchor traffic per fire: up {s['up_per_fire'] / 1e6:.2f} MB, "
                  f"down {s['down_per_fire'] / 1e3:.1f} KB")


if __name__ == "__main__":
    main(sys.argv[1:])
