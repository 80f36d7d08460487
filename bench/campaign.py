"""The training campaign's curves: held-out expected tau of each drafter against tokens seen and wall time, over
every leg (the legs a run continued, from its --init drafter's training record, come first).

    python -m bench.campaign --runs runs/moa_leg2 runs/eagle_leg2 --out runs/campaign

Periodic evaluations (`--eval-samples` conversations) are the thin lines; the final evaluation of each run
(eval.json, `--final-eval-samples`) is a star, joined to the final evaluations of the legs its training record
lists before it (the earlier legs of the drafter it continued). Writes
campaign.json and campaign.png.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from models.defaults import resolve_drafter_path


def run_curve(run: Path) -> dict:
    """One run directory -> {arch, points: [{tokens, wall_s, expected_tau, depth_agreement}], final}."""
    cfg = json.loads((run / "train_config.json").read_text())
    record_file = run / "drafter" / "training_record.json"
    record = json.loads(record_file.read_text()) if record_file.exists() else None
    prior = {"tokens": 0, "wall_s": 0.0}
    if record and record.get("legs"):  # a finished run: what its own record says came before its leg
        prior = {"tokens": record["tokens_seen"] - record["legs"][-1]["tokens"],
                 "wall_s": record["wall_time_s"] - record["legs"][-1]["wall_time_s"]}
    elif cfg.get("init"):  # still running: the drafter it continues (which a later leg may have replaced since)
        earlier = json.loads((resolve_drafter_path(cfg["init"]) / "config.json").read_text()).get("training") or {}
        prior = {"tokens": earlier.get("tokens_seen", 0), "wall_s": earlier.get("wall_time_s", 0.0)}
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    by_step = {r["step"]: r for r in rows if "loss" in r}  # a resumed run repeats steps: the last one counts
    evals = {r["step"]: r["eval"] for r in rows if "eval" in r and r["step"] in by_step}
    points = [{"step": step, "tokens": prior["tokens"] + by_step[step]["tokens"],
               "wall_s": prior["wall_s"] + by_step[step]["wall_s"], "expected_tau": ev["expected_tau"],
               "depth_agreement": ev["depth_agreement"]} for step, ev in sorted(evals.items())]
    final, legs = None, []
    if record:
        final = {"tokens": record["tokens_seen"], "wall_s": record["wall_time_s"],
                 "expected_tau": record["heldout"]["expected_tau"],
                 "depth_agreement": record["heldout"]["depth_agreement"]}
        tokens = wall_s = 0
        for leg in record.get("legs", []):  # every leg's final evaluation, at the tokens seen by its end
            tokens, wall_s = tokens + leg["tokens"], wall_s + leg["wall_time_s"]
            if leg["steps"] and leg.get("heldout"):
                legs.append({"tokens": tokens, "wall_s": wall_s, "expected_tau": leg["heldout"]["expected_tau"]})
    return {"run": str(run), "arch": cfg["arch"], "prior": prior, "points": points, "final": final, "legs": legs}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", nargs="+", required=True, help="training output directories (models.train --out)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if missing := [r for r in args.runs if not (Path(r) / "train_config.json").is_file()]:
        p.error(f"not a training output directory (no train_config.json): {', '.join(missing)}")
    curves = [run_curve(Path(r)) for r in args.runs]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "campaign.json").write_text(json.dumps(curves, indent=2) + "\n")
    plot(curves, out / "campaign.png")
    for c in curves:
        last = c["final"] or (c["points"][-1] if c["points"] else None)
        if last:
            print(f"{c['arch']}: {last['tokens']} tokens, {last['wall_s'] / 60:.0f} min, expected tau "
                  f"{last['expected_tau']:.3f}")
    print(f"wrote {out}/campaign.json, campaign.png")


def plot(curves: list[dict], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, key, label, scale in ((axes[0], "tokens", "tokens seen (all legs)", 1), (axes[1], "wall_s",
                                  "training wall time, minutes (all legs)", 60)):
        for arch in sorted({c["arch"] for c in curves}):
            legs = [c for c in curves if c["arch"] == arch]
            ends = {f["tokens"]: f for c in legs for f in c["legs"] + ([c["final"]] if c["final"] else [])}
            finals = [ends[t] for t in sorted(ends)]
            line, = ax.plot([f[key] / scale for f in finals], [f["expected_tau"] for f in finals], marker="*",
                            ms=12, label=f"{arch}: final evaluation of each leg")
            for c in legs:
                if c["points"]:
                    ax.plot([pt[key] / scale for pt in c["points"]], [pt["expected_tau"] for pt in c["points"]],
                            marker=".", lw=0.8, alpha=0.6, color=line.get_color())
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("held-out expected tau (chain, depth 6)")
    axes[0].legend(fontsize=8)
    fig.suptitle("Training campaign: MoA vs EAGLE on the same data")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
