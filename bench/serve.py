"""Many edges, one server: N concurrent clients per method (api streams vs EAGLE and MoA edges) against one verify
server per drafter, batching on and off, behind an emulated link (bench/link.py), all on one machine.

For every batching mode, link and client count, each method runs N clients at once over the same prompts (client i
answers prompts i, i+N, ... one after the other, so every client count serves the same work; all connected before a
barrier, so connection set-up is not timed). Figures per run:
- total_tokens_per_s: all clients' new tokens over the wall time from the barrier to the last client's end;
- client_tokens_per_s_median / _p95: per client, its tokens over its own time; p95 is the rate 95 % of clients
  reach or beat (the slow tail);
- ttft_s_median / _p95: time to the first streamed text of each reply (prefill + first round + link);
- server_forwards_per_token: target forwards the server ran (a batched forward counts once) per new token;
- server_ms_per_token: the server's busy wall time (at least one computation in flight) per new token;
- bytes_per_token: websocket frames both ways per new token, as the edge counts them;
- tau: tokens per verify (api: 1); outputs_match_api: clients whose tokens equal the api client's for that prompt
  in the same run setting (greedy; fp32 batch shapes may flip a near-tie token now and then).
The edges draft in ONNX Runtime on the same CPU as the server: on one machine they compete with it.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
import urllib.request
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm import tqdm

from bench.edge import DRAFTER_OF, METHODS, PLAIN_METHODS, session_options
from bench.link import LinkProfile, LinkProxy
from bench.prompts import Prompt
from bench.runs import BenchError, machine, now
from edge_client.client import EdgeSession, default_bundle
from server.process import ServerProcess


@dataclass
class ServeConfig:
    """What `python -m bench serve` runs."""

    clients: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    links: list[LinkProfile] = field(default_factory=list)
    methods: list[str] = field(default_factory=lambda: list(PLAIN_METHODS))
    batching: list[str] = field(default_factory=lambda: ["on", "off"])
    max_new_tokens: int = 64
    tree: str = "3,2,6"
    threads: int | None = None  # torch threads of the servers started here
    edge_threads: int = 1  # ONNX Runtime threads per edge
    dtype: str = "fp32"  # the shipped drafters' bundles
    quantize: str = "none"
    server_args: list[str] = field(default_factory=list)  # extra server arguments (e.g. --target for a test)
    drafters: dict[str, str] = field(default_factory=dict)  # drafter -> --drafter value (default: moa / eagle)
    bundles: dict[str, str] = field(default_factory=dict)  # drafter -> bundle directory (default: shipped)
    token: str | None = None
    progress: bool = True


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated q-th percentile (0..100)."""
    xs = sorted(values)
    if len(xs) == 1:
        return xs[0]
    k = (len(xs) - 1) * q / 100
    lo = int(k)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (k - lo)


def scrape(port: int) -> dict[str, float]:
    """The server's /metrics as name -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as r:
        lines = r.read().decode().splitlines()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines if line and line[0] != "#"}


def run_clients(sessions: list[EdgeSession], prompts: list[Prompt], max_new_tokens: int) -> dict:
    """Every prompt's first turn once, shared among the sessions at once: session i answers prompts i, i+n, ...
    one after the other, so that every client count serves the same work."""
    n = len(sessions)
    barrier = threading.Barrier(n + 1)
    out: list[dict | BaseException] = [RuntimeError("did not run")] * n

    def client(i: int) -> None:
        s = sessions[i]
        mine = list(range(i, len(prompts), n))
        done = {"tokens": {}, "new_tokens": 0, "ttft_s": [], "bytes": 0, "verify_calls": 0, "accepted_tokens": 0,
                "modes": []}
        try:
            barrier.wait(600)
            start = time.perf_counter()
            for j in mine:
                t, first = time.perf_counter(), None
                for chunk in s.generate([{"role": "user", "content": prompts[j].turns[0]}],
                                        max_new_tokens=max_new_tokens, seed=j):
                    if first is None and chunk:
                        first = time.perf_counter()
                st = s.stats
                done["tokens"][j] = s.result.token_ids
                done["ttft_s"].append((first or time.perf_counter()) - t)
                done["new_tokens"] += st.new_tokens
                done["bytes"] += st.bytes_up + st.bytes_down
                done["verify_calls"] += st.verify_calls
                done["accepted_tokens"] += st.accepted_tokens
                done["modes"].append(st.mode)
            end = time.perf_counter()
            out[i] = {**done, "total_s": end - start, "end": end}
        except BaseException as e:  # reported by the caller
            out[i] = e

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    barrier.wait(600)
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    errors = [e for e in out if isinstance(e, BaseException)]
    if errors:
        raise BenchError(f"{len(errors)} of {n} clients failed: {errors[0]!r}") from errors[0]
    return {"t0": t0, "clients": out}


def figures(run: dict, before: dict[str, float], after: dict[str, float]) -> dict:
    clients = run["clients"]
    new = sum(c["new_tokens"] for c in clients)
    wall = max(c["end"] for c in clients) - run["t0"]
    rates = [c["new_tokens"] / c["total_s"] for c in clients]
    ttft = [t for c in clients for t in c["ttft_s"]]
    calls = sum(c["verify_calls"] for c in clients)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    return {"clients": len(clients), "new_tokens": new, "wall_s": wall,
            "total_tokens_per_s": new / wall if wall else 0.0,
            "client_tokens_per_s_median": statistics.median(rates), "client_tokens_per_s_p95": percentile(rates, 5),
            "ttft_s_median": statistics.median(ttft), "ttft_s_p95": percentile(ttft, 95),
            "server_forwards_per_token": delta("moa_target_forwards_total") / max(1, new),
            "server_ms_per_token": 1000 * delta("moa_busy_seconds_total") / max(1, new),
            "bytes_per_token": sum(c["bytes"] for c in clients) / max(1, new),
            "tau": sum(c["accepted_tokens"] for c in clients) / calls if calls else 1.0,
            "api_share": statistics.mean(m == "api" for c in clients for m in c["modes"]),
            "mean_batch_size": (delta("moa_batch_size_sum") / delta("moa_batch_size_count")
                                if delta("moa_batch_size_count") else None)}


def run_serve(config: ServeConfig, prompts: list[Prompt], partial: Path | None = None) -> dict:
    """Every link x method x client count x batching mode; results.json's content. The batching modes run side by
    side (one server per drafter and mode, all started first) and alternate run by run, so that drift in machine
    load hits them alike."""
    unknown = [m for m in config.methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown method(s) {', '.join(unknown)} (choose from {', '.join(METHODS)})")
    drafters = sorted({DRAFTER_OF[m] for m in config.methods})
    bundles = {d: str(config.bundles.get(d) or default_bundle(d, config.dtype)) for d in drafters}
    widest = max(config.clients)
    rows: list[dict] = []
    outputs: dict[tuple, list[int]] = {}
    bar = tqdm(total=len(config.batching) * len(config.links) * len(config.clients) * len(config.methods),
               unit="run", desc="serve", disable=not config.progress)
    with ExitStack() as servers:
        procs = {}
        for mode in config.batching:
            for d in drafters:  # one after the other: each times its target at start, undisturbed
                args = ["--drafter", config.drafters.get(d, d), "--batching", mode, "--quantize", config.quantize,
                        "--log-level", "warning", "--max-sessions", str(2 * widest + 8), *config.server_args]
                procs[mode, d] = servers.enter_context(ServerProcess(args + (["--threads", str(config.threads)]
                                                                             if config.threads else [])))
        for link in config.links:
            with ExitStack() as proxies_stack:
                proxies = {k: proxies_stack.enter_context(LinkProxy("127.0.0.1", p.port, link))
                           for k, p in procs.items()}
                for m in config.methods:
                    d = DRAFTER_OF[m]
                    with ExitStack() as stack:
                        sessions = {mode: [stack.enter_context(EdgeSession(
                            bundles[d], proxies[mode, d].url, config.token, tree=config.tree,
                            threads=config.edge_threads, **session_options(m))) for _ in range(widest)]
                            for mode in config.batching}
                        for mode in config.batching:  # warm-up: one short generation
                            run_clients(sessions[mode][:1], prompts[:1], 8)
                        for n in config.clients:
                            for mode in config.batching:
                                bar.set_postfix_str(f"{link.name} {m} {n} clients batching {mode}")
                                port = procs[mode, d].port
                                before = scrape(port)
                                run = run_clients(sessions[mode][:n], prompts, config.max_new_tokens)
                                fig = figures(run, before, scrape(port))
                                for c in run["clients"]:
                                    for j, tokens in c["tokens"].items():
                                        outputs[mode, link.name, n, m, j] = tokens
                                ref = {j: outputs.get((mode, link.name, n, "api", j)) for j in range(len(prompts))}
                                fig["outputs_match_api"] = (statistics.mean(
                                    outputs[mode, link.name, n, m, j] == r for j, r in ref.items())
                                    if all(r is not None for r in ref.values()) else None)
                                rows.append({"batching": mode, "link": link.name, "method": m, **fig})
                                if partial is not None:
                                    with partial.open("a") as f:
                                        f.write(json.dumps(rows[-1]) + "\n")
                                bar.update()
    bar.close()
    rows.sort(key=lambda r: (config.links.index(next(p for p in config.links if p.name == r["link"])),
                             r["clients"], config.methods.index(r["method"]), config.batching.index(r["batching"])))
    return {"settings": {"benchmark": "serve", "machine": machine(), "date": now(), "prompts": len(prompts),
                         **{k: v for k, v in asdict(config).items() if k not in ("links", "progress")},
                         "links": {p.name: str(p) for p in config.links}, "bundles": bundles},
            "runs": rows, "outputs": [{"batching": k[0], "link": k[1], "clients": k[2], "method": k[3],
                                       "prompt": k[4], "tokens": v} for k, v in outputs.items()]}


COLUMNS = (("tokens/s", "total_tokens_per_s", "{:.1f}"), ("client tok/s median", "client_tokens_per_s_median",
                                                             "{:.1f}"),
           ("client tok/s p95", "client_tokens_per_s_p95", "{:.1f}"), ("TTFT median s", "ttft_s_median", "{:.2f}"),
           ("TTFT p95 s", "ttft_s_p95", "{:.2f}"), ("server fwd/token", "server_forwards_per_token", "{:.3f}"),
           ("server ms/token", "server_ms_per_token", "{:.1f}"), ("bytes/token", "bytes_per_token", "{:.0f}"),
           ("tau", "tau", "{:.2f}"), ("mean batch", "mean_batch_size", "{:.1f}"),
           ("matches api", "outputs_match_api", "{:.0%}"))


def markdown(results: dict) -> str:
    """One row per link, client count, method and batching mode, plus the batching / FIFO throughput ratio."""
    runs = results["runs"]
    key = {(r["batching"], r["link"], r["clients"], r["method"]): r for r in runs}
    header = ["link", "clients", "method", "batching"] + [c[0] for c in COLUMNS] + ["batching / FIFO"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in runs:
        other = key.get(("off", r["link"], r["clients"], r["method"]))
        ratio = (f"{r['total_tokens_per_s'] / other['total_tokens_per_s']:.2f}x"
                 if r["batching"] == "on" and other else "-")
        cells = ["-" if r.get(k) is None else f.format(r[k]) for _, k, f in COLUMNS]
        lines.append("| " + " | ".join([r["link"], str(r["clients"]), r["method"], r["batching"]] + cells + [ratio])
                     + " |")
    return "\n".join(lines) + "\n"


def summary(results: dict) -> str:
    """Total tokens/s per link and client count, a column per method and batching mode, and each method's
    batching / FIFO ratio and speedup over api in the same mode."""
    runs = results["runs"]
    key = {(r["link"], r["clients"], r["method"], r["batching"]): r["total_tokens_per_s"] for r in runs}
    methods = list(dict.fromkeys(r["method"] for r in runs))
    modes = list(dict.fromkeys(r["batching"] for r in runs))
    label = {"on": "batching", "off": "FIFO"}
    cols = [(m, b) for m in methods for b in modes]
    header = ["link", "clients"] + [f"{m} {label[b]}" for m, b in cols]
    header += [f"{m} batching / FIFO" for m in methods] if set(modes) == {"on", "off"} else []
    header += [f"{m} / api, {label[b]}" for m in methods if m != "api" for b in modes] if "api" in methods else []
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]

    def ratio(a: tuple, b: tuple) -> str:
        return f"{key[a] / key[b]:.2f}x" if a in key and b in key and key[b] else "-"

    for link, n in dict.fromkeys((r["link"], r["clients"]) for r in runs):
        cells = [f"{key[link, n, m, b]:.1f}" if (link, n, m, b) in key else "-" for m, b in cols]
        if set(modes) == {"on", "off"}:
            cells += [ratio((link, n, m, "on"), (link, n, m, "off")) for m in methods]
        if "api" in methods:
            cells += [ratio((link, n, m, b), (link, n, "api", b)) for m in methods if m != "api" for b in modes]
        lines.append("| " + " | ".join([link, str(n)] + cells) + " |")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    """Total tokens/s against clients, one panel per link, a line per method and batching mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = results["runs"]
    links = list(dict.fromkeys(r["link"] for r in runs))
    fig, axes = plt.subplots(1, len(links), figsize=(5 * len(links), 4), squeeze=False)
    for ax, link in zip(axes[0], links):
        for method in dict.fromkeys(r["method"] for r in runs):
            for mode, style in (("on", "-o"), ("off", "--s")):
                pts = sorted((r["clients"], r["total_tokens_per_s"]) for r in runs
                             if r["link"] == link and r["method"] == method and r["batching"] == mode)
                if pts:
                    ax.plot(*zip(*pts), style, label=f"{method}, batching {mode}")
        ax.set_title(f"link {link}")
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel("total tokens/s")
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(results: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    outputs = results.pop("outputs")
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "outputs.jsonl").write_text("".join(json.dumps(o) + "\n" for o in outputs))
    (out / "results.md").write_text("Total tokens/s\n\n" + summary(results) + "\nEvery figure\n\n" + markdown(results))
    plot(results, out / "results.png")
