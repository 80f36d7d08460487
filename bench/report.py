"""results.json -> a markdown table (results.md) and a bar chart of speedup and tau per method and category, for
both benchmarks (`settings.benchmark`: single or edge)."""

from __future__ import annotations

from pathlib import Path

COMMON = (("tau", "tau", "{:.2f}"), ("tokens/s", "tokens_per_s", "{:.1f}"),
          ("predicted tokens/s", "predicted_tokens_per_s", "{:.1f}"), ("prediction error", "predicted_error", "{:+.0%}"),
          ("median tokens/s", "tokens_per_s_median", "{:.1f}"), ("speedup", "speedup", "{:.2f}x"))
COLUMNS = {
    "single": COMMON + (("target fwd/token", "target_forwards_per_token", "{:.3f}"),
                        ("matches vanilla", "outputs_match_vanilla", "{:.0%}")),
    "edge": COMMON + (("server calls/token", "server_calls_per_token", "{:.3f}"),
                      ("server ms/token", "server_ms_per_token", "{:.1f}"), ("bytes/token", "bytes_per_token", "{:.0f}"),
                      ("network wait", "network_wait_share", "{:.0%}"), ("matches api", "outputs_match_api", "{:.0%}")),
}
BASELINE = {"single": "vanilla", "edge": "api"}
TITLE = {"single": "Single-device benchmark", "edge": "Client-server benchmark"}


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


def markdown_table(results: dict) -> str:
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
    trees = ", ".join(f"{m} {t}" for m, t in s["tree"].items() if t != "none")
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
        text += f"\n![speedup and tau]({image})\n"
    Path(path).write_text(text)
    return text


def plot(results: dict, path: str | Path) -> None:
    """Two panels (speedup, tau), bars per method grouped by 'all' and category."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

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
