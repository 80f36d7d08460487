"""results.json -> a markdown table (results.md) and a chart, for every benchmark (`settings.benchmark`): single
and edge get bars of speedup and tau per method and category, offline a plot of agreement with the target by
offline position."""

from __future__ import annotations

from pathlib import Path

COMMON = (("tau", "tau", "{:.2f}"), ("tokens/s", "tokens_per_s", "{:.1f}"),
          ("predicted tokens/s", "predicted_tokens_per_s", "{:.1f}"),
          ("prediction error", "predicted_error", "{:+.0%}"), ("median tokens/s", "tokens_per_s_median", "{:.1f}"),
          ("speedup", "speedup", "{:.2f}x"))
COLUMNS = {
    "single": COMMON + (("tau speculating", "tau_speculating", "{:.2f}"), ("plain rounds", "plain_round_share", "{:.0%}"),
                        ("target fwd/token", "target_forwards_per_token", "{:.3f}"),
                        ("matches vanilla", "outputs_match_vanilla", "{:.0%}")),
    "edge": COMMON + (("server calls/token", "server_calls_per_token", "{:.3f}"),
                      ("server ms/token", "server_ms_per_token", "{:.1f}"),
                      ("bytes/token", "bytes_per_token", "{:.0f}"),
                      ("network wait", "network_wait_share", "{:.0%}"), ("replies to api", "api_share", "{:.0%}"),
                      ("handed over", "handover_share", "{:.0%}"), ("matches api", "outputs_match_api", "{:.0%}")),
}
OFFLINE_COLUMNS = (("cases", "cases", "{}"), ("exact prefix (kept by verify)", "exact_prefix", "{:.2f}"),
                   ("agreement 1-8", "agreement_1_8", "{:.1%}"), ("agreement 1-32", "agreement_mean", "{:.1%}"),
                   ("teacher-forced 1-32", "teacher_forced_mean", "{:.1%}"),
                   ("repeated 4-grams", "repeated_ngram", "{:.1%}"), ("longest newline run", "newline_run_max", "{}"),
                   ("degenerate", "degenerate", "{:.0%}"))
BASELINE = {"single": "vanilla", "edge": "api"}
TITLE = {"single": "Single-device benchmark", "edge": "Client-server benchmark",
         "offline": "Offline continuation benchmark"}


def kind(results: dict) -> str:
    return results["settings"].get("benchmark", "single")


def groups(results: dict) -> list[str]:
    """'all', then the categories when there are several."""
    cats = list(next(iter(results["methods"].values()))["per_category"])
    return ["all"] + (cats if len(cats) > 1 else [])


def figures(results: dict, method: str, group: str) -> dict:
    m = results["methods"][method]
    return m if group == "all" else m["per_category"][group]


def cell(value, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def offline_table(results: dict) -> str:
    """One row per method and cut; the target's own continuation is the reference (its agreement is 100 %)."""
    header = ["method", "cut"] + [c[0] for c in OFFLINE_COLUMNS]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for cut in map(str, results["settings"]["cuts"]):
        for method, per_cut in results["methods"].items():
            if cut in per_cut:
                fig = {**per_cut[cut], "agreement_1_8": sum(per_cut[cut]["agreement"][:8]) / 8}
                if method == "target":
                    fig = {k: v for k, v in fig.items() if k not in ("exact_prefix", "agreement_1_8", "agreement_mean")}
                lines.append("| " + " | ".join([method, cut] + [cell(fig.get(k), f) for _, k, f in OFFLINE_COLUMNS])
                             + " |")
    if results.get("comparisons"):
        lines += ["", "| case by case | cut | cases | agreement 1-32, difference | 95 % interval | cases ahead |",
                  "|---|---|---|---|---|---|"]
        for pair, per_cut in results["comparisons"].items():
            for cut, c in per_cut.items():
                lo, hi = c["ci95"]
                lines.append(f"| {pair} | {cut} | {c['cases']} | {100 * c['mean']:+.1f} pt | {100 * lo:+.1f} to "
                             f"{100 * hi:+.1f} pt | {c['first_better']} vs {c['second_better']} |")
    return "\n".join(lines)


def markdown_table(results: dict) -> str:
    if kind(results) == "offline":
        return offline_table(results)
    columns = COLUMNS[kind(results)]
    header = ["method", "prompts"] + [c[0] for c in columns]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for group in groups(results):
        for method in results["methods"]:
            fig = figures(results, method, group)
            lines.append("| " + " | ".join([method, group] + [cell(fig.get(k), f) for _, k, f in columns]) + " |")
    return "\n".join(lines)


def settings_line(results: dict) -> str:
    s = results["settings"]
    if kind(results) == "offline":
        guard = next((d["guard"] for d in s["decoding"].values() if d["guard"]), None)
        return (f"{s['target']} on {s['machine']['processor']} ({s['threads']} threads); {s['n_prompts']} prompts "
                f"(first turn), link cut after {', '.join(map(str, s['cuts']))} verified tokens, {s['offline_tokens']} "
                f"offline tokens; guard {guard}; {s['date']}")
    used = s.get("rounds_by_tree", {})  # tree auto: the rounds each tree ran
    trees = ", ".join(f"{m} " + (" / ".join(f"{t} ({n} rounds)" for t, n in used[m].items()) if used.get(m) else t)
                      for m, t in s["tree"].items() if t != "none")
    run = (f"{s['n_prompts']} prompts, max_new_tokens {s['max_new_tokens']}, temperature {s['temperature']}; "
           f"trees (depth,topk,total): {trees or 'none'}; {s['date']}")
    if kind(results) == "edge":
        bundles = ", ".join(f"{m} {d} on {s['providers'][m]}" for m, d in s["dtype"].items())
        return (f"{s['target']}; servers {', '.join(f'{d} {u}' for d, u in s['servers'].items())}; edge bundles "
                f"{bundles or 'none'}; {s['machine']['processor']}, threads {s['threads'] or 'default'}; {run}")
    return (f"{s['target']} on {s['machine']['processor']} ({s['threads']} threads, {s['device']}, {s['dtype']}), "
            f"torch {s['torch']}; {run}")


def write_markdown(results: dict, path: str | Path, image: str | None = None) -> str:
    text = f"# {TITLE[kind(results)]}\n\n{settings_line(results)}\n\n{markdown_table(results)}\n"
    if image:
        alt = "agreement by offline position" if kind(results) == "offline" else "speedup and tau"
        text += f"\n![{alt}]({image})\n"
    Path(path).write_text(text)
    return text


def plot(results: dict, path: str | Path) -> None:
    """Two panels (speedup, tau), bars per method grouped by 'all' and category; offline: `plot_offline`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    if kind(results) == "offline":
        return plot_offline(results, path, plt)

    names = groups(results)
    methods = list(results["methods"])
    x = np.arange(len(names))
    width = 0.8 / len(methods)
    fig, axes = plt.subplots(1, 2, figsize=(5 + 2 * len(names), 4))
    for ax, key, title in ((axes[0], "speedup", f"speedup over {BASELINE[kind(results)]} (tokens/s)"),
                           (axes[1], "tau", "tau (tokens per target forward)")):
        for i, method in enumerate(methods):
            values = [figures(results, method, g)[key] or 0.0 for g in names]
            bars = ax.bar(x + (i - (len(methods) - 1) / 2) * width, values, width, label=method)
            ax.bar_label(bars, fmt="%.2f", fontsize=7)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xticks(x, names)
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    s = results["settings"]
    fig.suptitle(f"{TITLE[kind(results)]}: {s['target']}, {s['n_prompts']} prompts, T={s['temperature']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_offline(results: dict, path: str | Path, plt) -> None:
    """One panel per cut: agreement with the target's token at each offline position, per method (solid), and the
    neural drafters' teacher-forced agreement (dashed)."""
    s = results["settings"]
    cuts = [str(c) for c in s["cuts"]]
    fig, axes = plt.subplots(1, len(cuts), figsize=(5.5 * len(cuts), 4), squeeze=False, sharey=True)
    for ax, cut in zip(axes[0], cuts):
        for method, per_cut in results["methods"].items():
            if method == "target" or cut not in per_cut:
                continue
            f = per_cut[cut]
            x = range(1, len(f["agreement"]) + 1)
            (line,) = ax.plot(x, f["agreement"], label=method, lw=1.5)
            if "teacher_forced" in f:
                ax.plot(x, f["teacher_forced"], ls="--", lw=1, color=line.get_color(),
                        label=f"{method} (teacher-forced)")
        ax.set_title(f"link cut after {cut} verified tokens ({next(iter(results['methods'].values()))[cut]['cases']} "
                     f"cases)", fontsize=9)
        ax.set_xlabel("offline position")
        ax.set_ylim(0, 1)
    axes[0][0].set_ylabel("agreement with the target's token")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(f"{TITLE['offline']}: {s['target']}, {s['n_prompts']} prompts", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
