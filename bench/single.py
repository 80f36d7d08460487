"""Single-device benchmark: vanilla, prompt lookup, EAGLE-2 and MoA side by side in one run (DESIGN.md §9).

Prompts are interleaved: for each prompt every method runs, so that drift in machine load hits all methods alike.
Each prompt's turns run as a multi-turn chat (each answer is appended as the assistant message before the next
turn). Figures per method, overall and per category:
- tau: mean tokens gained per target forward over all decoding rounds (bonus token included, prefill excluded);
- tokens_per_s: total new tokens / total generation time; tokens_per_s_median: median over prompts;
- speedup: tokens_per_s over vanilla's in the same run;
- target_forwards_per_token: target forwards (prefills included) per new token;
- outputs_match_vanilla (greedy only): the share of prompts whose token ids equal vanilla's.
"""

from __future__ import annotations

import os
import platform
import statistics
from dataclasses import dataclass, field
from datetime import datetime, timezone

import torch
from tqdm import tqdm

from bench.prompts import Prompt
from models.engine import SpeculativeEngine
from models.target import Target

METHODS = ("vanilla", "lookup", "eagle", "moa")
WARMUP_TOKENS = 16


@dataclass
class Run:
    """One method on one prompt, all turns together."""

    question_id: str
    category: str
    method: str
    texts: list[str] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)
    new_tokens: int = 0
    total_s: float = 0.0
    gained: int = 0  # tokens gained over all decoding rounds
    rounds: int = 0
    target_forwards: int = 0
    drafter_calls: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0


def build_engines(target: Target, methods: list[str], tree: str, drafters: dict[str, str]) -> dict[str, SpeculativeEngine]:
    """One engine per method; `drafters` maps moa/eagle to a shipped name or a drafter directory."""
    from models.drafter import load_drafter

    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown method(s) {', '.join(unknown)} (choose from {', '.join(METHODS)})")
    engines = {}
    for m in methods:
        drafter = None if m == "vanilla" else "lookup" if m == "lookup" else load_drafter(drafters[m], target)
        engines[m] = SpeculativeEngine(target, drafter, tree=tree)
    return engines


def run_prompt(engine: SpeculativeEngine, method: str, prompt: Prompt, seed: int, **gen) -> Run:
    """All turns of one prompt as a chat; each answer becomes the assistant message before the next turn."""
    run = Run(prompt.question_id, prompt.category, method)
    messages: list[dict] = []
    for turn in prompt.turns:
        messages.append({"role": "user", "content": turn})
        res = engine.generate(messages, seed=seed, **gen)
        messages.append({"role": "assistant", "content": res.text})
        s = res.stats
        run.texts.append(res.text)
        run.token_ids.append(res.token_ids)
        run.new_tokens += s.new_tokens
        run.total_s += s.total_s
        run.gained += sum(s.acceptance_lengths)
        run.rounds += len(s.acceptance_lengths)
        run.target_forwards += s.target_forwards
        run.drafter_calls += s.drafter_calls
        run.draft_s += s.draft_s
        run.verify_s += s.verify_s
    return run


def summarize(runs: list[Run], vanilla: list[Run] | None, greedy: bool) -> dict:
    """The figures of one method over `runs` (speedup is filled in by the caller)."""
    new = sum(r.new_tokens for r in runs)
    seconds = sum(r.total_s for r in runs)
    out = {
        "tau": sum(r.gained for r in runs) / max(1, sum(r.rounds for r in runs)),
        "tokens_per_s": new / seconds if seconds else 0.0,
        "tokens_per_s_median": statistics.median(r.new_tokens / r.total_s for r in runs),
        "speedup": None,
        "target_forwards_per_token": sum(r.target_forwards for r in runs) / max(1, new),
        "outputs_match_vanilla": None,
        "new_tokens": new,
        "time_s": seconds,
        "draft_s": sum(r.draft_s for r in runs),
        "verify_s": sum(r.verify_s for r in runs),
    }
    if greedy and vanilla is not None:
        out["outputs_match_vanilla"] = sum(r.token_ids == v.token_ids for r, v in zip(runs, vanilla)) / len(runs)
    return out


def aggregate(runs: dict[str, list[Run]], greedy: bool) -> dict:
    """results["methods"]: per method the figures overall and per category, speedups against vanilla."""
    categories = sorted({r.category for r in next(iter(runs.values()))})

    def figures(selected: dict[str, list[Run]]) -> dict[str, dict]:
        base = selected.get("vanilla")
        out = {m: summarize(rs, base, greedy) for m, rs in selected.items()}
        if base is not None:
            for fig in out.values():
                fig["speedup"] = fig["tokens_per_s"] / out["vanilla"]["tokens_per_s"]
        return out

    overall = figures(runs)
    per_cat = {c: figures({m: [r for r in rs if r.category == c] for m, rs in runs.items()}) for c in categories}
    return {m: {**overall[m], "per_category": {c: per_cat[c][m] for c in categories}} for m in runs}


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


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
    gen = {"max_new_tokens": max_new_tokens, "temperature": temperature}
    warm = Prompt("warmup", "warmup", prompts[0].turns[:1])
    for method, engine in engines.items():
        run_prompt(engine, method, warm, seed, max_new_tokens=min(WARMUP_TOKENS, max_new_tokens),
                   temperature=temperature)
    runs: dict[str, list[Run]] = {m: [] for m in engines}
    bar = tqdm(total=len(prompts) * len(engines), unit="gen", desc="bench", disable=not progress)
    for i, prompt in enumerate(prompts):
        for method, engine in engines.items():
            bar.set_postfix_str(f"{prompt.question_id} {method}")
            runs[method].append(run_prompt(engine, method, prompt, seed + i, **gen))
            bar.update()
    bar.close()
    settings = {
        "machine": {"platform": platform.platform(), "processor": cpu_name(), "cpu_count": os.cpu_count()},
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "device": str(target.device),
        "dtype": str(target.dtype).removeprefix("torch."),
        "tree": {m: str(e.tree) if e.tree else "none" for m, e in engines.items()},
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "seed": seed,
        "n_prompts": len(prompts),
        "target": target.name,
        "drafters": {m: str(p) for m, p in (drafter_paths or {}).items() if m in engines},
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    return {"settings": settings, "methods": aggregate(runs, temperature <= 0)}, [r for rs in runs.values() for r in rs]
