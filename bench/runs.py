"""What the benchmarks share: a prompt's turns run as one chat, totals per run, figures per method (overall and
per category) against a baseline method, and the machine they ran on."""

from __future__ import annotations

import os
import platform
import statistics
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Callable

from tqdm import tqdm

from bench.prompts import Prompt

WARMUP_TOKENS = 16


class BenchError(RuntimeError):
    """A benchmark that cannot go on (a client failed, the link proxy did not start): said in one line, unlike a
    bug's traceback."""


# one chat turn: messages so far -> (reply text, reply token ids, figures to add up, e.g. new_tokens and total_s)
Turn = Callable[[list[dict]], tuple[str, list[int], dict[str, float]]]


@dataclass
class Run:
    """One method on one prompt, all turns together."""

    question_id: str
    category: str
    method: str
    texts: list[str] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)
    totals: dict[str, float] = field(default_factory=dict)  # summed over the turns; always new_tokens and total_s


def run_chat(turn: Turn, method: str, prompt: Prompt) -> Run:
    """All turns of one prompt as a chat; each answer becomes the assistant message before the next turn."""
    run = Run(prompt.question_id, prompt.category, method)
    messages: list[dict] = []
    for user in prompt.turns:
        messages.append({"role": "user", "content": user})
        text, ids, figures = turn(messages)
        messages.append({"role": "assistant", "content": text})
        run.texts.append(text)
        run.token_ids.append(ids)
        for key, value in figures.items():
            run.totals[key] = run.totals.get(key, 0) + value
    return run


def run_interleaved(make_turn: Callable[[str, int, int], Turn], methods: list[str], prompts: list[Prompt],
                    max_new_tokens: int, seed: int = 0, progress: bool = True) -> dict[str, list[Run]]:
    """A short warm-up per method, then every method on every prompt, interleaved prompt by prompt so that drift in
    machine load hits all methods alike. `make_turn(method, seed, max_new_tokens)`: prompt i uses seed + i."""
    warm = Prompt("warmup", "warmup", prompts[0].turns[:1])
    for method in methods:
        run_chat(make_turn(method, seed, min(WARMUP_TOKENS, max_new_tokens)), method, warm)
    runs: dict[str, list[Run]] = {m: [] for m in methods}
    bar = tqdm(total=len(prompts) * len(methods), unit="gen", desc="bench", disable=not progress)
    for i, prompt in enumerate(prompts):
        for method in methods:
            bar.set_postfix_str(f"{prompt.question_id} {method}")
            runs[method].append(run_chat(make_turn(method, seed + i, max_new_tokens), method, prompt))
            bar.update()
    bar.close()
    return runs


def total(runs: list[Run], key: str) -> float:
    return sum(r.totals.get(key, 0) for r in runs)


def predicted(runs: list[Run]) -> dict:
    """predicted_tokens_per_s (new tokens over the predicted seconds, `predicted_s` of every turn) and
    predicted_error (predicted / measured - 1); None where some run has no prediction."""
    if not runs or any("predicted_s" not in r.totals for r in runs):
        return {"predicted_tokens_per_s": None, "predicted_error": None}
    rate = total(runs, "new_tokens") / max(1e-9, total(runs, "predicted_s"))
    measured = total(runs, "new_tokens") / max(1e-9, total(runs, "total_s"))
    return {"predicted_tokens_per_s": rate, "predicted_error": rate / measured - 1}


def aggregate(runs: dict[str, list[Run]], baseline: str, greedy: bool,
              summarize: Callable[[list[Run]], dict]) -> dict:
    """results["methods"]: per method, overall and per category, tokens_per_s (total new tokens / total time),
    tokens_per_s_median (over prompts), speedup (tokens_per_s over the baseline's in the same run) and, greedy,
    outputs_match_<baseline> (the share of prompts whose token ids equal the baseline's), plus `summarize`'s."""
    categories = sorted({r.category for r in next(iter(runs.values()))})
    match_key = f"outputs_match_{baseline}"

    def figures(selected: dict[str, list[Run]]) -> dict[str, dict]:
        out = {}
        for method, rs in selected.items():
            new, seconds = total(rs, "new_tokens"), total(rs, "total_s")
            out[method] = {"tokens_per_s": new / seconds if seconds else 0.0,
                           "tokens_per_s_median": statistics.median(r.totals["new_tokens"] / r.totals["total_s"]
                                                                    for r in rs),
                           "speedup": None, match_key: None, "new_tokens": new, "time_s": seconds, **summarize(rs)}
        base = selected.get(baseline)
        if base is not None:
            for method, fig in out.items():
                fig["speedup"] = fig["tokens_per_s"] / out[baseline]["tokens_per_s"]
                if greedy:
                    fig[match_key] = sum(r.token_ids == b.token_ids for r, b in zip(selected[method], base)) / len(base)
        return out

    overall = figures(runs)
    per_cat = {c: figures({m: [r for r in rs if r.category == c] for m, rs in runs.items()}) for c in categories}
    return {m: {**overall[m], "per_category": {c: per_cat[c][m] for c in categories}} for m in runs}


def rounds_by_tree(tuners: dict) -> dict[str, dict[str, int]]:
    """Per method with tree auto, the speculative rounds each tree ran (`TreeTuner` chooses again between
    generations)."""
    return {m: {str(t): n for t, n in tuner.observed().items()} for m, tuner in tuners.items() if tuner is not None}


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def machine() -> dict:
    return {"platform": platform.platform(), "processor": cpu_name(), "cpu_count": os.cpu_count()}


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
