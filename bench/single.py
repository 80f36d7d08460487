"""Single-device benchmark: vanilla, prompt lookup, EAGLE-2 and MoA side by side in one run (docs/design.md §9).

Prompts are interleaved: for each prompt every method runs, so that drift in machine load hits all methods alike.
Each prompt's turns run as a multi-turn chat (each answer is appended as the assistant message before the next
turn). Figures per method, overall and per category:
- tau: mean tokens gained per target forward over all decoding rounds (bonus token included, prefill excluded);
- tau_speculating: the same over the rounds that verified drafts, without the rounds the Pacer decoded plainly (one
  token each; plain_round_share says how many): what a drafter gains where it is used, apart from how often;
- tokens_per_s: total new tokens / total generation time; tokens_per_s_median: median over prompts;
- speedup: tokens_per_s over vanilla's in the same run;
- target_forwards_per_token: target forwards (prefills included) per new token;
- predicted_tokens_per_s: what the engine predicted before each generation (`Forecast`: the cost model's prefill and
  rounds at the predicted tau, or plain decoding where it predicted speculation not to pay, refreshed by the
  generations observed before, warm-up included), next to the measured tokens_per_s; predicted_error = predicted /
  measured - 1 (None where a generation had nothing to predict with: prompt lookup before any observation);
- outputs_match_vanilla (greedy only): the share of prompts whose token ids equal vanilla's;
- copy_round_share (the +copy methods): rounds that verified a copy chain (`SpeculativeEngine`'s `copy_tokens`,
  `--copy-tokens`; `vanilla+copy`: copies alone, no drafter).
"""

from __future__ import annotations

import torch

from bench.prompts import Prompt
from bench.runs import Run, Turn, aggregate, machine, now, predicted, rounds_by_tree, run_interleaved, total
from moa_core.lookup import COPY_TOKENS
from models.engine import SpeculativeEngine, TorchDraftStep
from models.target import Target

METHODS = ("vanilla", "lookup", "eagle", "moa", "vanilla+copy", "eagle+copy", "moa+copy")  # +copy: copy chains


def build_engines(target: Target, methods: list[str], tree: str, drafters: dict[str, str],
                  copy_tokens: int = COPY_TOKENS) -> dict[str, SpeculativeEngine]:
    """One engine per method; `drafters` maps moa/eagle to a shipped name or a drafter directory; the +copy methods
    verify copy chains of up to `copy_tokens`."""
    from models.registry import load_drafter

    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown method(s) {', '.join(unknown)} (choose from {', '.join(METHODS)})")
    engines = {}
    for m in methods:
        name = m.removesuffix("+copy")
        drafter = None if name == "vanilla" else "lookup" if name == "lookup" else load_drafter(drafters[name], target)
        engines[m] = SpeculativeEngine(target, drafter, tree=tree, copy_tokens=copy_tokens if m != name else 0)
        engines[m].measure_costs()
    return engines


def engine_turn(engine: SpeculativeEngine, seed: int, **gen) -> Turn:
    def turn(messages: list[dict]) -> tuple[str, list[int], dict[str, float]]:
        res = engine.generate(messages, seed=seed, **gen)
        s = res.stats
        return res.text, res.token_ids, {
            "new_tokens": s.new_tokens, "total_s": s.total_s, "gained": sum(s.acceptance_lengths),
            "rounds": len(s.acceptance_lengths), "target_forwards": s.target_forwards, "drafter_calls": s.drafter_calls,
            "draft_s": s.draft_s, "verify_s": s.verify_s, "plain_rounds": s.plain_rounds,
            "copy_rounds": s.copy_rounds,
            **({"predicted_s": s.predicted_s} if s.predicted_s is not None else {})}
    return turn


def summarize(runs: list[Run]) -> dict:
    """The single-device figures beyond tokens/s: tau, target forwards per token, time drafting and verifying,
    rounds decoded plainly, the cost model's prediction."""
    rounds, plain = total(runs, "rounds"), total(runs, "plain_rounds")
    return {"tau": total(runs, "gained") / max(1, rounds),
            "tau_speculating": (total(runs, "gained") - plain) / (rounds - plain) if rounds > plain else None,
            "target_forwards_per_token": total(runs, "target_forwards") / max(1, total(runs, "new_tokens")),
            "draft_s": total(runs, "draft_s"), "verify_s": total(runs, "verify_s"),
            "plain_round_share": plain / max(1, rounds),
            "copy_round_share": total(runs, "copy_rounds") / max(1, rounds), **predicted(runs)}


def run_single(
    target: Target,
    engines: dict[str, SpeculativeEngine],
    prompts: list[Prompt],
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    drafter_paths: dict[str, str] | None = None,
    progress: bool = True,
) -> tuple[dict, list[Run]]:
    """Warm up every method once, then run every method on every prompt, interleaved. Returns (results, runs)."""
    runs = run_interleaved(lambda m, seed, n: engine_turn(engines[m], seed, max_new_tokens=n, temperature=temperature),
                           list(engines), prompts, max_new_tokens, seed, progress)
    settings = {
        "benchmark": "single",
        "machine": machine(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "device": str(target.device),
        "dtype": str(target.dtype).removeprefix("torch."),
        "quantize": target.quantize,
        "tree": {m: str(e.tree) if e.tree else "none" for m, e in engines.items()},
        "rounds_by_tree": rounds_by_tree({m: e.tuner for m, e in engines.items()}),
        "draft_dtype": {m: str(e.step.dtype).removeprefix("torch.") for m, e in engines.items()
                        if isinstance(e.step, TorchDraftStep)},
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "seed": seed,
        "n_prompts": len(prompts),
        "target": target.label,
        "drafters": {m: str(p) for m, p in (drafter_paths or {}).items()
                     if m in {e.removesuffix("+copy") for e in engines}},
        "date": now(),
    }
    results = {"settings": settings, "methods": aggregate(runs, "vanilla", temperature <= 0, summarize)}
    return results, [r for rs in runs.values() for r in rs]
