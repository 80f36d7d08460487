"""The training campaign's curves: held-out expected tau of each drafter against tokens seen and wall time, over
every leg (the legs a run continued, from its --init drafter's training record, come first).

    python -m bench.campaign --runs runs/moa_leg2 runs/eagle_leg2 --out runs/campaign

Periodic evaluations (`--eval-samples` conversations) are the thin lines; the final evaluation of each run
(eval.json, `--final-eval-samples`) is a star, joined to the final evaluations of the legs its training record
lists before it (the earlier legs of the drafter it continued). Writes
campaign.json and campaign.png.

How far off a goal is: over the legs scored on the same held-out set as the last one, expected tau is fitted
against the logarithm of the tokens seen (least squares, the dashed line), which gives the gain per doubling of
the training data and the tokens at which the fit reaches `--goal`. It is an extrapolation of the campaign so far
(same drafters, same kind of data, same recipe), not a promise.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from models.defaults import resolve_drafter_path
from models.drafter import RECORD_FILE


def run_curve(run: Path) -> dict:
    """One run directory -> {arch, points: [{tokens, wall_s, expected_tau, depth_agreement}], final}."""
    record_file = run / "drafter" / RECORD_FILE
    record = json.loads(record_file.read_text()) if record_file.exists() else None
    cfg_file = run / "train_config.json"  # an average of legs (models.average) has only its record
    cfg = json.loads(cfg_file.read_text()) if cfg_file.exists() else {"arch": record["arch"]}
    prior = {"tokens": 0, "wall_s": 0.0}
    if record and record.get("legs"):  # a finished run: what its own record says came before its leg
        prior = {"tokens": record["tokens_seen"] - record["legs"][-1]["tokens"],
                 "wall_s": record["wall_time_s"] - record["legs"][-1]["wall_time_s"]}
    elif cfg.get("init"):  # still running: the drafter it continues (which a later leg may have replaced since)
        earlier = json.loads((resolve_drafter_path(cfg["init"]) / "config.json").read_text()).get("training") or {}
        prior = {"tokens": earlier.get("tokens_seen", 0), "wall_s": earlier.get("wall_time_s", 0.0)}
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")] if (run / "metrics.jsonl").exists() else []
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
                legs.append({"tokens": tokens, "wall_s": wall_s, "expected_tau": leg["heldout"]["expected_tau"],
                             "heldout": heldout_set(leg)})
    return {"run": str(run), "arch": cfg["arch"], "prior": prior, "points": points, "final": final, "legs": legs}


def heldout_set(leg: dict) -> str:
    """Which answers a leg's final evaluation scored (file name and count): only legs scored alike are fitted."""
    source = (leg.get("data") or {}).get("heldout_source") or "random split"
    return f"{Path(source).name}:{leg['config'].get('final_eval_samples')}"


def log_fit(finals: list[dict], goal: float) -> dict | None:
    """Least-squares fit of expected tau = a + b ln(tokens) over the leg ends scored on the last one's held-out
    set; None with fewer than three such legs."""
    same = [f for f in finals if f.get("heldout") == finals[-1].get("heldout")] if finals else []
    if len(same) < 3:
        return None
    x = [math.log(f["tokens"]) for f in same]
    y = [f["expected_tau"] for f in same]
    mx, my = sum(x) / len(x), sum(y) / len(y)
    b = sum((xi - mx) * (yi - my) for xi, yi in zip(x, y)) / sum((xi - mx) ** 2 for xi in x)
    a = my - b * mx
    to_goal = math.exp((goal - a) / b) if b > 0 else None
    return {"a": a, "b": b, "per_doubling": b * math.log(2), "legs": len(same), "heldout": same[-1]["heldout"],
            "tokens": [same[0]["tokens"], same[-1]["tokens"]], "goal": goal, "tokens_to_goal": to_goal}


def leg_ends(curves: list[dict], arch: str, run_finals: bool = False) -> list[dict]:
    """Every leg's final evaluation of one drafter, by tokens seen (runs that share legs list them once); with
    `run_finals`, also each run's own final evaluation (a record from before legs were kept has only that)."""
    ends: dict[int, dict] = {}
    for c in curves:
        if c["arch"] == arch:
            for f in c["legs"] + ([c["final"]] if run_finals and c["final"] else []):
                ends.setdefault(f["tokens"], f)
    return [ends[t] for t in sorted(ends)]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", nargs="+", required=True, help="training output directories (models.train or models.average --out)")
    p.add_argument("--out", required=True)
    p.add_argument("--goal", type=float, default=2.5, help="expected tau the log fit is asked to reach (issue 10: 2.5)")
    args = p.parse_args(argv)
    if missing := [r for r in args.runs if not (Path(r) / "train_config.json").is_file()
                   and not (Path(r) / "drafter" / RECORD_FILE).is_file()]:
        p.error(f"not a training output directory (no train_config.json or drafter/{RECORD_FILE}): "
                f"{', '.join(missing)}")
    curves = [run_curve(Path(r)) for r in args.runs]
    for c in curves:
        c["fit"] = log_fit(leg_ends(curves, c["arch"]), args.goal)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "campaign.json").write_text(json.dumps(curves, indent=2) + "\n")
    plot(curves, out / "campaign.png")
    for c in curves:
        last = c["final"] or (c["points"][-1] if c["points"] else None)
        if last:
            print(f"{c['arch']}: {last['tokens']} tokens, {last['wall_s'] / 60:.0f} min, expected tau "
                  f"{last['expected_tau']:.3f}")
        if fit := c["fit"]:
            goal = f"{fit['tokens_to_goal'] / 1e6:.0f}M tokens" if fit["tokens_to_goal"] else "never (no gain)"
            print(f"  log fit over {fit['legs']} legs ({fit['tokens'][0] / 1e6:.2f}M-{fit['tokens'][1] / 1e6:.2f}M "
                  f"tokens, held-out {fit['heldout']}): {fit['per_doubling']:+.3f} per doubling of the tokens; "
                  f"expected tau {fit['goal']} at {goal}")
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
            finals = leg_ends(curves, arch, run_finals=True)
            line, = ax.plot([f[key] / scale for f in finals], [f["expected_tau"] for f in finals], marker="*",
                            ms=12, label=f"{arch}: final evaluation of each leg")
            fit = legs[-1]["fit"]
            if fit and key == "tokens":
                xs = [fit["tokens"][0] * (fit["tokens"][1] * 2 / fit["tokens"][0]) ** (i / 40) for i in range(41)]
                ax.plot(xs, [fit["a"] + fit["b"] * math.log(t) for t in xs], ls="--", lw=1, color=line.get_color(),
                        label=f"{arch}: log fit, {fit['per_doubling']:+.3f} per doubling")
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
