"""Client-server benchmark: the server generating alone (`api`, the usual deployment) against the EAGLE and MoA
edge bundles drafting in ONNX Runtime while the verify server checks their trees, side by side in one run
(docs/design.md §9). This is the edge client's view: its own clock, its own byte counts.

Each drafter needs a server whose memory head matches its bundle: one server per drafter, started on loopback
unless given; `api` asks the MoA server (any server generates the same vanilla text). The +copy methods verify copy
chains (`api+copy`: the server's own, while it generates alone). With tree auto a speculative method hands the rest
of a reply to the server once speculation stops paying in it (`EdgeSession(handover=True)`); the -stay methods
speculate to the end of every reply, for comparison. Figures per method, overall
and per category, beyond tokens/s, speedup (over api) and outputs_match_api (greedy):
- tau: tokens gained per verify call, the server's next token included (api: 1, one target forward per token);
- server_calls_per_token: requests (prefill, verify, generate) per new token;
- server_ms_per_token: the server's own compute per new token, as its replies report it;
- bytes_per_token: frames up and down per new token (memory rows included);
- network_wait_share: the share of the time the edge waited on the server (round trips, server compute included);
- draft_share: the share of the time the edge spent drafting;
- api_share: the share of a speculative method's generations the server made alone because speculation did not pay;
- handover_share: the share of a speculative method's tokens the server made alone after a handover mid-reply;
- copy_round_share (the +copy methods): the share of rounds (verify calls, or the server's own in api mode) that
  verified a copy chain;
- predicted_tokens_per_s: what the edge predicted before each generation (moa_core.budget.Forecast: the cost
  model from the server's measured costs, the edge's draft step, the round trip and the drafter's held-out
  acceptance, refreshed by the generations observed before in the mode it runs), next to tokens_per_s;
  predicted_error = predicted / measured - 1.
"""

from __future__ import annotations

from contextlib import ExitStack

from bench.prompts import Prompt
from bench.runs import Run, Turn, aggregate, machine, now, predicted, rounds_by_tree, run_interleaved, total
from edge_client.client import EdgeSession, default_bundle
from moa_core.lookup import COPY_TOKENS
from server.process import ServerProcess

# +copy: with copy chains; -stay: no handover to the server mid-reply
METHODS = ("api", "eagle", "moa", "api+copy", "eagle+copy", "moa+copy", "eagle-stay", "moa-stay")
PLAIN_METHODS = METHODS[:3]  # the default of `bench edge` and `bench serve`: the server alone, each drafter alone
DRAFTER_OF = {m: "moa" if m.startswith("api") else m.split("+")[0].split("-")[0] for m in METHODS}  # bundle, server


def session_options(method: str, copy_tokens: int = COPY_TOKENS) -> dict:
    """The EdgeSession options of a method: api* has the server generate alone, +copy verifies copies, -stay
    speculates to the end of every reply."""
    return {"mode": "api" if method.startswith("api") else "speculative",
            "copy_tokens": copy_tokens if method.endswith("+copy") else 0, "handover": not method.endswith("-stay")}


def session_turn(session: EdgeSession, seed: int, **gen) -> Turn:
    def turn(messages: list[dict]) -> tuple[str, list[int], dict[str, float]]:
        res = session.complete(messages, seed=seed, **gen)
        s = session.stats
        return res.text, res.token_ids, {
            "generations": 1, "api_generations": int(s.mode == "api"), "handover_tokens": s.handover_tokens,
            **({"predicted_s": s.predicted_s} if s.predicted_s is not None else {}),
            "new_tokens": s.new_tokens, "total_s": s.total_s, "verify_calls": s.verify_calls,
            "copy_rounds": s.copy_rounds,
            "accepted_tokens": s.accepted_tokens, "server_calls": s.server_calls, "server_s": s.server_s,
            "bytes": s.bytes_up + s.bytes_down, "network_wait_s": s.network_wait_s, "draft_s": s.draft_s}
    return turn


def summarize(runs: list[Run]) -> dict:
    new, seconds = max(1, total(runs, "new_tokens")), max(1e-9, total(runs, "total_s"))
    calls = total(runs, "verify_calls")
    return {"tau": total(runs, "accepted_tokens") / calls if calls else 1.0,
            "server_calls_per_token": total(runs, "server_calls") / new,
            "server_ms_per_token": 1000 * total(runs, "server_s") / new,
            "bytes_per_token": total(runs, "bytes") / new,
            "network_wait_share": total(runs, "network_wait_s") / seconds,
            "draft_share": total(runs, "draft_s") / seconds,
            "api_share": total(runs, "api_generations") / max(1, total(runs, "generations")),
            "handover_share": total(runs, "handover_tokens") / new,
            "copy_round_share": total(runs, "copy_rounds") / max(1, calls), **predicted(runs)}


def run_edge(methods: list[str], prompts: list[Prompt], max_new_tokens: int, temperature: float = 0.0,
             seed: int = 0, tree: str = "auto", dtype: str = "fp32", bundles: dict[str, str] | None = None,
             servers: dict[str, str] | None = None, token: str | None = None, threads: int | None = None,
             quantize: str = "none", copy_tokens: int = COPY_TOKENS, progress: bool = True) -> tuple[dict, list[Run]]:
    """Run the methods side by side. `bundles` and `servers` map a drafter (moa, eagle) to a bundle directory and a
    server URL; missing bundles are the shipped drafters' (exported on first use, in `dtype`), missing servers are
    started here on loopback with that drafter (`threads` torch threads, the target `quantize`d) and stopped at the
    end. Every method must see the same target: servers that report different ones are refused. The +copy methods
    verify copy chains of up to `copy_tokens`."""
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown method(s) {', '.join(unknown)} (choose from {', '.join(METHODS)})")
    bundles, servers = dict(bundles or {}), dict(servers or {})
    drafters = sorted({DRAFTER_OF[m] for m in methods})
    for d in drafters:
        bundles[d] = str(bundles.get(d) or default_bundle(d, dtype))
    with ExitStack() as stack:
        local = [d for d in drafters if d not in servers]
        for d in local:  # one after the other: each times its target at start, undisturbed by the others
            server = ServerProcess(["--drafter", d, "--quantize", quantize, "--log-level", "warning"] +
                                   (["--threads", str(threads)] if threads else []))
            servers[d] = stack.enter_context(server).url
        sessions = {m: stack.enter_context(EdgeSession(bundles[DRAFTER_OF[m]], servers[DRAFTER_OF[m]], token,
                                                       tree=tree, threads=threads,
                                                       **session_options(m, copy_tokens)))
                    for m in methods}
        targets = {s.target for s in sessions.values()}
        if len(targets) > 1:
            raise ValueError(f"the servers run different targets ({', '.join(sorted(targets))}): the methods would "
                             "not be comparable")
        runs = run_interleaved(
            lambda m, seed, n: session_turn(sessions[m], seed, max_new_tokens=n, temperature=temperature),
            methods, prompts, max_new_tokens, seed, progress)
    settings = {
        "benchmark": "edge",
        "machine": machine(),
        "threads": threads,
        "target": sessions[methods[0]].target,
        "bundles": {m: bundles[DRAFTER_OF[m]] for m in methods if sessions[m].mode != "api"},
        "dtype": {m: sessions[m].bundle.meta.get("dtype") for m in methods if sessions[m].mode != "api"},
        "providers": {m: sessions[m].step.provider for m in methods if sessions[m].mode != "api"},
        "servers": {d: ("local " if d in local else "") + servers[d] for d in drafters},
        "tree": {m: f"{sessions[m].tree} ({sessions[m].tree_note})" for m in methods if sessions[m].mode != "api"},
        "rounds_by_tree": rounds_by_tree({m: sessions[m].tuner for m in methods}),
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "seed": seed,
        "n_prompts": len(prompts),
        "date": now(),
    }
    results = {"settings": settings, "methods": aggregate(runs, "api", temperature <= 0, summarize)}
    return results, [r for rs in runs.values() for r in rs]

