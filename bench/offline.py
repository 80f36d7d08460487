"""Offline continuation benchmark: the paper's disconnection experiment (issue 13).

For each prompt the target answers greedily (what lossless online decoding shows, token for token). At each cut N
the link drops after N verified tokens: the drafter holds the memory rows of the prompt and those N tokens, the
target's next token (the pending root) is known, and the drafter continues alone for `offline` tokens. Those are
scored against the target's own greedy continuation from the same point.

It runs on one device in PyTorch (the target's activations give the memory rows, as the server computes them), but
the offline tokens come from the edge's own code: `DraftSession.next_token` with the `OfflineGuard`, exactly what
`EdgeSession` runs when offline (there on the ONNX graph of the same drafter). Methods: `moa` (memory frozen at
the cut), `eagle` (feeding its own predicted features back, docs/design.md §4), each also `+guard` (the offline guard),
and `lookup` (prompt lookup: the token that followed the latest match of the transcript's last n-gram).

Figures per method and cut:
- exact_prefix: offline tokens equal to the target's before the first difference; a greedy `--on-reconnect
  verify` resume keeps exactly these (the server checks the offline tokens with one target forward and keeps them
  up to the first disagreement);
- agreement[i]: the share of cases whose offline token i (1-based) equals the target's token i;
- teacher_forced[i] (neural drafters, unguarded): the drafter's token i given the target's tokens before it, with
  the memory still frozen at the cut: how far from its last sync the drafter stays right;
- repeated_ngram: the share of the offline text's 4-grams already seen earlier in it; newline_run: the longest run
  of newlines (whitespace between them allowed); degenerate: the share of cases with repeated_ngram > 0.25 or a
  newline run > 2. `target` is the same measure on the target's own continuation, for reference.

`comparisons`: MoA against EAGLE case by case (unguarded and guarded, per cut): the mean difference of their
agreement over the offline tokens with a 95 % bootstrap interval, and how many cases each agreed more on. A gap of
a point on 50 cases is usually inside the interval: the interval says whether a ranking is the drafters' or luck's.
"""

from __future__ import annotations

import re
import statistics

import numpy as np
import torch
from tqdm import tqdm

from bench.prompts import Prompt
from bench.runs import machine, now
from moa_core.drafting import DraftSession, OfflineGuard
from models.engine import SpeculativeEngine, TorchDraftStep
from moa_core.lookup import MAX_NGRAM, MIN_NGRAM, find_continuation
from models.target import Target

METHODS = ("moa", "eagle", "lookup")
PAIRS = (("moa", "eagle"), ("moa+guard", "eagle+guard"))  # compared case by case when both ran
RESAMPLES = 10_000
NGRAM = 4
LOOP_SHARE = 0.25  # repeated_ngram above this is a loop
NEWLINE_RUN = re.compile(r"\n(?:[ \t]*\n)*")


def repeated_ngrams(tokens: list[int], n: int = NGRAM) -> float:
    """The share of n-grams that already occurred earlier in `tokens` (0: none, near 1: one loop)."""
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return sum(g in set(grams[:i]) for i, g in enumerate(grams)) / len(grams) if grams else 0.0


def newline_run(text: str) -> int:
    """The longest run of newlines in `text`, whitespace between them allowed."""
    return max((m.group().count("\n") for m in NEWLINE_RUN.finditer(text)), default=0)


def score(tokens: list[int], reference: list[int], text: str) -> dict:
    """One offline continuation against the target's."""
    agree = [i < len(tokens) and tokens[i] == r for i, r in enumerate(reference)]
    exact = agree.index(False) if False in agree else len(agree)
    rep, nl = repeated_ngrams(tokens), newline_run(text)
    return {"exact_prefix": exact, "agreement": agree, "repeated_ngram": rep, "newline_run": nl,
            "degenerate": rep > LOOP_SHARE or nl > 2, "produced": len(tokens)}


class Continuer:
    """Offline continuations of one method: `run(context, rows, root, n)` -> the offline tokens after root."""

    def __init__(self, target: Target, drafter=None, guard: OfflineGuard | None = None, temperature: float = 0.0):
        self.target, self.temperature = target, temperature
        self.guard = None
        if guard is not None:
            vocabulary = target.tokenizer.batch_decode([[i] for i in range(len(target.tokenizer))])
            special = set(target.tokenizer.all_special_ids) | set(target.eos_token_ids)
            self.guard = guard.for_vocabulary(vocabulary, special)
        self.step = TorchDraftStep(drafter) if drafter is not None else None

    def memory_rows(self, step, n: int) -> np.ndarray:
        return self.step.memory_rows(step, list(range(n)))

    def session(self, context: list[int], rows: np.ndarray) -> DraftSession:
        """The drafter as the edge holds it when the link drops: the verified transcript and its memory rows."""
        session = DraftSession(self.step)
        session.add_verified(context, rows)
        return session

    def run(self, context: list[int], rows: np.ndarray | None, root: int, n: int,
            rng: np.random.Generator) -> list[int]:
        out: list[int] = []
        session = self.session(context, rows) if self.step is not None else None
        token = root
        while len(out) < n and token not in self.target.eos_token_ids:
            if session is None:  # prompt lookup: stops when nothing in the transcript matches
                found = find_continuation(context + [root] + out, MAX_NGRAM, MIN_NGRAM, 1)
                if not found:
                    break
                token = found[0]
            else:
                token = session.next_token(token, self.temperature, rng, self.guard)
            out.append(token)
        return out

    def teacher_forced(self, context: list[int], rows: np.ndarray, root: int, reference: list[int]) -> list[bool]:
        """Whether the drafter's token i matches the target's, given the target's tokens before it."""
        session = self.session(context, rows)
        fed = [root] + reference[:-1]
        return [session.next_token(t) == r for t, r in zip(fed, reference)]


def build_continuers(target: Target, methods: list[str], drafters: dict[str, str], guard: OfflineGuard | None,
                     temperature: float = 0.0) -> dict[str, Continuer]:
    """`moa`/`eagle` unguarded and (unless `guard` is None) `+guard`, and `lookup`; `drafters` maps moa/eagle to a
    shipped name or a directory."""
    from models.drafter import require_edge_drafter
    from models.registry import load_drafter

    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown method(s) {', '.join(unknown)} (choose from {', '.join(METHODS)})")
    out = {}
    for m in methods:
        if m == "lookup":
            out[m] = Continuer(target)
            continue
        drafter = require_edge_drafter(load_drafter(drafters[m], target))  # offline is the edge's, alone
        out[m] = Continuer(target, drafter, None, temperature)
        if guard is not None:
            out[f"{m}+guard"] = Continuer(target, drafter, guard, temperature)
    return out


def run_offline(target: Target, continuers: dict[str, Continuer], prompts: list[Prompt], cuts: list[int],
                offline: int = 32, seed: int = 0, progress: bool = True) -> tuple[dict, list[dict]]:
    """Every method at every cut of every prompt (first turn). Returns (results, one record per case)."""
    vanilla = SpeculativeEngine(target, None)
    records = []
    for i, prompt in enumerate(tqdm(prompts, unit="prompt", desc="offline", disable=not progress)):
        ids = target.encode_chat([{"role": "user", "content": prompt.turns[0]}])
        reply = vanilla.generate(ids, max_new_tokens=max(cuts) + 1 + offline).token_ids
        for cut in cuts:
            if len(reply) < cut + 1 + offline:  # the target's answer ends before the offline stretch does
                continue
            context, root, reference = ids + reply[:cut], reply[cut], reply[cut + 1:cut + 1 + offline]
            with torch.no_grad():
                step = target.new_runner().forward(context)
            base = {"question_id": prompt.question_id, "category": prompt.category, "cut": cut}
            records.append({**base, "method": "target", "tokens": reference,
                            **score(reference, reference, target.tokenizer.decode(reference))})
            for name, c in continuers.items():
                rows = c.memory_rows(step, len(context)) if c.step is not None else None
                tokens = c.run(context, rows, root, offline, np.random.default_rng(seed + i))
                record = {**base, "method": name, "tokens": tokens,
                          **score(tokens, reference, target.tokenizer.decode(tokens))}
                if c.step is not None and c.guard is None:
                    record["teacher_forced"] = c.teacher_forced(context, rows, root, reference)
                records.append(record)
    settings = {"benchmark": "offline", "machine": machine(), "threads": torch.get_num_threads(),
                "target": target.name, "cuts": cuts, "offline_tokens": offline, "n_prompts": len(prompts),
                "decoding": {name: {"guard": c.guard.settings if c.guard else None, "temperature": c.temperature}
                             for name, c in continuers.items() if c.step is not None},
                "seed": seed, "date": now()}
    return {"settings": settings, "methods": summarize(records, ["target", *continuers], cuts),
            "comparisons": compare(records, cuts, seed)}, records


def compare(records: list[dict], cuts: list[int], seed: int = 0) -> dict:
    """Per pair of PAIRS and cut: agreement over the offline tokens, first minus second, case by case."""
    score_of = {(r["method"], r["cut"], r["question_id"]): float(np.mean(r["agreement"])) for r in records}
    rng = np.random.default_rng(seed)
    out: dict = {}
    for a, b in PAIRS:
        for cut in cuts:
            cases = sorted(q for (m, c, q) in score_of if m == a and c == cut and (b, cut, q) in score_of)
            if not cases:
                continue
            diff = np.array([score_of[a, cut, q] - score_of[b, cut, q] for q in cases])
            means = diff[rng.integers(0, len(diff), (RESAMPLES, len(diff)))].mean(axis=1)
            out.setdefault(f"{a} - {b}", {})[str(cut)] = {
                "cases": len(cases), "mean": float(diff.mean()),
                "ci95": [float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975))],
                "first_better": int((diff > 0).sum()), "second_better": int((diff < 0).sum())}
    return out


def summarize(records: list[dict], methods: list[str], cuts: list[int]) -> dict:
    """Per method and cut: means of the scores, agreement per offline position, share of degenerate cases."""
    out: dict = {}
    for m in methods:
        out[m] = {}
        for cut in cuts:
            rs = [r for r in records if r["method"] == m and r["cut"] == cut]
            if not rs:
                continue
            fig = {"cases": len(rs), "exact_prefix": statistics.mean(r["exact_prefix"] for r in rs),
                   "agreement": np.mean([r["agreement"] for r in rs], axis=0).tolist(),
                   "repeated_ngram": statistics.mean(r["repeated_ngram"] for r in rs),
                   "newline_run_max": max(r["newline_run"] for r in rs),
                   "degenerate": statistics.mean(r["degenerate"] for r in rs),
                   "produced": statistics.mean(r["produced"] for r in rs)}
            fig["agreement_mean"] = float(np.mean(fig["agreement"]))
            if "teacher_forced" in rs[0]:
                fig["teacher_forced"] = np.mean([r["teacher_forced"] for r in rs], axis=0).tolist()
                fig["teacher_forced_mean"] = float(np.mean(fig["teacher_forced"]))
            out[m][str(cut)] = fig
    return out
