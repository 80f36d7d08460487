"""`--tree auto`: the draft tree budget (depth, frontier width) that maximises predicted tokens per second, and
the online check that speculation still pays (`Pacer`).

Tokens per second of a tree with depth D and frontier width k is tau(D, k) / round time, where
tau(D, k) = 1 + sum_{d<=D} prod_{j<=d} a_j(k) uses the drafter's held-out top-k agreement per depth (from its
training record) and the round time is
- the draft: one priming call plus D-1 calls over k frontier nodes;
- the verify round on the target's side over 1 + D*k tokens, everything included: the forward, the LM head over
  the tree's rows, keeping the accepted path, the memory rows of the root, plus `row_s` for
  each further accepted token (`Costs`, measured at two context lengths and interpolated);
- one round trip between an edge and a server (0 on one device).
The baseline makes one token per plain decode step (`Costs.decode_s`): vanilla decoding, or the server alone (api).
A generation also pays its prefill (`Costs.prefill_s` per prompt token). What a generation will take (`Forecast`)
starts from these figures and follows what earlier generations took, all overheads included. All times are
measured where they are spent: on one device by the engine (models/costmodel.py); between an edge and a server,
the server measures its costs at start and sends them in `welcome`, the edge measures its own draft step and the
round trip. On a CPU a
bigger verify costs much more; on a big GPU 64 tokens cost about what one does, and the same code picks a wider
tree. Torch-free: the edge uses it.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Mapping

import numpy as np

from moa_core.tree import TreeConfig

DEPTHS = range(1, 9)
WIDTHS = (1, 2, 4, 8)
MAX_TREE = 65  # the largest verify measured: root + 8 x 8
FALLBACK_AGREEMENT = [0.6, 0.5, 0.45, 0.4, 0.35, 0.3]  # used when a drafter has no held-out record


def expected_tau(agreement: list[float]) -> float:
    """Expected tokens per target forward of a chain with these per-depth acceptance rates (bonus included)."""
    tau, prod = 1.0, 1.0
    for a in agreement:
        prod *= a
        tau += prod
    return tau


def agreement_table(topk: Mapping | None) -> dict[int, list[float]]:
    """Per-width, per-depth acceptance estimates: a training record's `depth_agreement_topk` ({width: [a_1..]}),
    or a generic guess without one."""
    if not topk:
        return {w: [min(0.95, 1 - (1 - a) ** w) for a in FALLBACK_AGREEMENT] for w in WIDTHS}
    return {int(w): list(v) for w, v in topk.items()}


def tree_sizes(limit: int = MAX_TREE) -> list[int]:
    """Token counts of every candidate verify (root + depth * width), up to `limit`."""
    return sorted({1} | {n for d in DEPTHS for w in WIDTHS if (n := 1 + d * w) <= limit})


def time_calls(fn: Callable[[], object], repeats: int = 3, warmup: int = 1) -> list[float]:
    """Seconds of each of `repeats` calls of `fn`, after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times


def time_call(fn: Callable[[], object], repeats: int = 3) -> float:
    """Median seconds of `fn` after one warm-up call."""
    return float(np.median(time_calls(fn, repeats)))


def time_interleaved(fns: Mapping[Any, Callable[[], object]], repeats: int = 3) -> dict[Any, float]:
    """Median seconds of each call, timed in turns after one warm-up each: a load that changes while timing hits
    every call alike, so their ratios, which decide the budget, hold even on a busy machine."""
    for fn in fns.values():
        fn()
    times: dict[Any, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t)
    return {k: float(np.median(v)) for k, v in times.items()}


def verify_probes(limit: int = MAX_TREE) -> list[int]:
    """The verify sizes to time: 1 and 2 both (on a CPU one token takes a matrix-vector path and two already cost
    up to twice as much, which decides whether a chain pays), then powers of two up to the largest candidate."""
    sizes = tree_sizes(limit)
    return sorted({s for s in (1, 2, 4, 8, 16, 32, 64) if s <= sizes[-1]} | {sizes[-1]})


def interp_size(by_n: Mapping[int, float], n: float) -> float:
    """Seconds of a verify of n tokens, interpolated linearly between the sizes in `by_n`."""
    sizes = sorted(by_n)
    return float(np.interp(n, sizes, [by_n[s] for s in sizes]))


def by_size(measured: Mapping[int, float], limit: int = MAX_TREE) -> dict[int, float]:
    """Seconds of every candidate verify size, interpolated between the timed `verify_probes`."""
    return {n: interp_size(measured, n) for n in tree_sizes(limit)}


def draft_inputs(step, n: int, row_width: int, hidden_size: int, context: int = 256, memory: int = 256) -> tuple:
    """Arguments of one draft step over a tree frontier of n nodes (each sees the cache and itself) after `context`
    cached slots, with `memory` memory rows, for any step with the DraftStep signature. Latency does not depend on
    the values, so they are zeros."""
    heads, head_dim = step.cache_shape
    cache = np.zeros((heads, context, head_dim), np.float32)
    mask = np.zeros((n, context + n), np.float32)
    mask[:, context:] = np.where(np.eye(n, dtype=bool), 0.0, -np.inf)
    return (np.full(n, 1), np.full(n, context), cache, cache, mask, np.zeros((memory, row_width), np.float32),
            np.zeros((n, hidden_size), np.float32))


def measure_draft(step, row_width: int, hidden_size: int, context: int = 256) -> dict[int, float]:
    """Seconds of one draft step over w nodes (w in WIDTHS) with a draft cache and memory of `context` (ONNX Runtime
    on the edge, PyTorch on one device)."""
    def timed(w: int) -> float:
        args = draft_inputs(step, w, row_width, hidden_size, context, context)
        return time_call(lambda: step(*args))

    return {w: timed(w) for w in WIDTHS}


@dataclass
class Costs:
    """What the target's side of a round costs, measured at `contexts` (two lengths; linear in between and beyond).

    verify_s[i][n]: a verify round of n tokens at contexts[i], overheads and the root's memory rows included;
    decode_s[i]: one plain decode step (the baseline's token); row_s: memory rows of each further accepted token;
    prefill_s: the target's prefill per prompt token; prompt_rows_s: the prompt's memory rows per token."""

    contexts: list[int]
    verify_s: list[dict[int, float]]
    decode_s: list[float]
    row_s: float
    prefill_s: float
    prompt_rows_s: float

    def _at(self, values: list[float], context: float) -> float:
        (c0, c1), (v0, v1) = self.contexts, values
        return max(0.0, v0 + (v1 - v0) * (context - c0) / (c1 - c0))

    def verify(self, context: float) -> dict[int, float]:
        """Verify round seconds by size at this context."""
        return {n: self._at([self.verify_s[0][n], self.verify_s[1][n]], context) for n in self.verify_s[0]}

    def verify_at(self, context: float, n: float) -> float:
        """Verify round seconds of n tokens at this context (interpolated between the measured sizes)."""
        return interp_size(self.verify(context), n)

    def round_target_s(self, context: float, n: float, gained: float) -> float:
        """The target's side of a speculative round at this context: the verify of n tokens, and the memory rows
        of each token `gained` beyond the root."""
        return self.verify_at(context, n) + (gained - 1) * self.row_s

    def decode(self, context: float) -> float:
        return self._at(self.decode_s, context)

    def to_wire(self) -> dict[str, Any]:
        """For `welcome.costs` (JSON: string keys)."""
        return {**asdict(self), "verify_s": [{str(n): t for n, t in v.items()} for v in self.verify_s]}

    @classmethod
    def from_wire(cls, fields: Mapping[str, Any]) -> "Costs":
        return cls(list(fields["contexts"]), [{int(n): float(t) for n, t in v.items()} for v in fields["verify_s"]],
                   [float(t) for t in fields["decode_s"]], float(fields["row_s"]), float(fields["prefill_s"]),
                   float(fields["prompt_rows_s"]))


@dataclass
class Choice:
    tree: TreeConfig
    tau: float  # predicted tokens per round
    round_s: float  # predicted seconds per round (draft + verify round + accepted tokens' rows + link)
    baseline_s: float  # predicted seconds per baseline token (a plain decode step; + nothing: api streams)

    @property
    def tokens_per_s(self) -> float:
        return self.tau / self.round_s

    @property
    def baseline_tokens_per_s(self) -> float:
        return 1.0 / self.baseline_s

    @property
    def pays(self) -> bool:
        return self.tokens_per_s >= self.baseline_tokens_per_s

    def describe(self) -> str:
        return (f"depth={self.tree.depth} topk={self.tree.topk} total_tokens={self.tree.total_tokens}, predicted tau "
                f"{self.tau:.2f}, {self.tokens_per_s:.1f} tokens/s vs {self.baseline_tokens_per_s:.1f} without a "
                "drafter")


def chain_tau(acc: list[float], depth: int) -> float:
    """Predicted tokens per round of a tree `depth` deep from one width's per-depth agreement `acc` (depths beyond
    the record fall by 0.9 each)."""
    return expected_tau((acc + [acc[-1] * 0.9 ** i for i in range(1, 9)])[:depth])


def predict(tree: TreeConfig, agreement: dict[int, list[float]], draft_s: Mapping[int, float],
            verify_s: Mapping[int, float], link_s: float = 0.0, row_s: float = 0.0, baseline_s: float = 0.0) -> Choice:
    """What a round of `tree` is predicted to gain and cost."""
    w, depth = tree.topk, tree.depth
    tau = chain_tau(agreement[w], depth)
    seconds = draft_s[1] + (depth - 1) * draft_s[w] + verify_s[1 + depth * w] + (tau - 1) * row_s + link_s
    return Choice(tree, tau, seconds, baseline_s)


def choose(agreement: dict[int, list[float]], draft_s: Mapping[int, float], verify_s: Mapping[int, float],
           link_s: float = 0.0, row_s: float = 0.0, baseline_s: float | None = None) -> Choice:
    """The budget with the most predicted tokens per second among those whose verify size was measured.

    `verify_s`: verify round seconds by size, `row_s`: per further accepted token, `baseline_s`: one baseline
    token (default: a verify round of 1)."""
    baseline_s = verify_s[1] if baseline_s is None else baseline_s
    candidates = [predict(TreeConfig(depth, w, depth * w), agreement, draft_s, verify_s, link_s, row_s, baseline_s)
                  for w in WIDTHS if agreement.get(w) for depth in DEPTHS if 1 + depth * w in verify_s]
    if not candidates:
        raise ValueError("no candidate tree: no measured verify size fits")
    return max(candidates, key=lambda c: c.tokens_per_s)  # the first of equals: the smallest width, then depth


class TreeTuner:
    """Tree auto's budget, chosen again from what rounds gain.

    The drafter's held-out agreement predicts tokens per round that a deployment's prompts need not give (s18: MoA
    4,8,32 predicted 3.38 and gained 2.95). `observe` records each speculative round of a tuned tree; `rechoose`
    scales the agreement table by the one factor that makes it predict the tokens per round observed so far, over
    every tree tried (the start-up prediction counting as `prior_rounds` rounds of the first), and picks the budget
    again with it and the verify round as re-timed (`Pacer.verify_scale`). The factor stays at most 1: rounds of a
    shallow tree that beat the table say nothing about deeper drafts, and a table scaled up from them would send a
    deep tree. It keeps the current tree unless another is predicted faster by `margin`, so that near-equal
    budgets do not flap. Call it between generations: the Pacer's rates are per tree (`Pacer.retarget`)."""

    def __init__(self, agreement: dict[int, list[float]], draft_s: Mapping[int, float],
                 verify_s: Mapping[int, float], link_s: float = 0.0, row_s: float = 0.0,
                 baseline_s: float | None = None, prior_rounds: int = 32, margin: float = 0.03):
        self.agreement, self.draft_s, self.verify_s = agreement, dict(draft_s), dict(verify_s)
        self.link_s, self.row_s, self.margin = link_s, row_s, margin
        self.baseline_s = verify_s[1] if baseline_s is None else baseline_s
        self.choice = choose(agreement, draft_s, verify_s, link_s, row_s, self.baseline_s)
        self.factor = 1.0  # the scale the last `rechoose` took
        # (tree, tokens, rounds): the start-up prediction as `prior_rounds` rounds of the first tree
        self._prior = (self.choice.tree, self.choice.tau * prior_rounds, prior_rounds)
        self._seen: dict[TreeConfig, list[int]] = {}  # observed: tree -> [tokens, rounds]

    def observed(self) -> dict[TreeConfig, int]:
        """Rounds observed, by tree."""
        return {tree: rounds for tree, (_, rounds) in self._seen.items()}

    def observe(self, tree: TreeConfig, tokens: int) -> None:
        """A speculative round of `tree` (drafter only: no copy chain grafted on) gained `tokens`, bonus included."""
        seen = self._seen.setdefault(tree, [0, 0])
        seen[0] += tokens
        seen[1] += 1

    def scaled(self, factor: float) -> dict[int, list[float]]:
        return {w: [min(0.99, a * factor) for a in acc] for w, acc in self.agreement.items()}

    def scale(self) -> float:
        """The factor (at most 1) on every agreement that makes the table predict the tokens observed (bisection:
        the predicted tokens rise with it; at 0 every round gains the root alone)."""
        records = [self._prior] + [(tree, t, n) for tree, (t, n) in self._seen.items()]
        tokens = sum(t for _, t, _ in records)

        def predicted(factor: float) -> float:
            table = self.scaled(factor)
            return sum(n * chain_tau(table[tree.topk], tree.depth) for tree, _, n in records)

        lo, hi = 0.0, 1.0
        if predicted(hi) <= tokens:
            return hi
        for _ in range(40):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if predicted(mid) < tokens else (lo, mid)
        return (lo + hi) / 2

    def rechoose(self, verify_scale: float = 1.0) -> Choice:
        """The budget for the next generation (`choice`, updated): the current one unless another is predicted
        faster by `margin` with the scaled table and verify rounds taking `verify_scale` x their measured time."""
        self.factor = self.scale()
        table = self.scaled(self.factor)
        verify = {n: s * verify_scale for n, s in self.verify_s.items()}
        args = (self.draft_s, verify, self.link_s, self.row_s, self.baseline_s)
        best, now = choose(table, *args), predict(self.choice.tree, table, *args)
        self.choice = best if best.tokens_per_s > now.tokens_per_s * (1 + self.margin) else now
        return self.choice

    def retune(self, pacer: Pacer) -> str | None:
        """Between generations: choose again (`rechoose`, the verify round as `pacer` re-timed it); when the tree
        changes, the pacer follows it and what to tell the user is returned."""
        tree = self.choice.tree
        choice = self.rechoose(pacer.verify_scale)
        if choice.tree == tree:
            return None
        pacer.retarget(choice)
        return f"tree auto: {choice.describe()}, chosen again from the rounds so far (held-out agreement x " \
               f"{self.factor:.2f})"


def prior_s(costs: Costs, choice: Choice | None, prompt_tokens: int, new_tokens: int, plain: bool = False,
            link_s: float = 0.0) -> tuple[float, float] | None:
    """What the cost model predicts a generation costs: (prefill seconds, generation seconds).

    Plain decoding (`plain`, or a `choice` predicted not to pay): the prefill and one decode step per token.
    Speculation: the prefill with the prompt's memory rows, then rounds at the predicted tau, the verify round
    taken at the generation's mean context. `link_s`: one round trip before the first token (an edge). None: no
    prediction to make (speculation with a given tree, or a drafter without an acceptance record)."""
    context = prompt_tokens + new_tokens / 2
    prefill = link_s + prompt_tokens * costs.prefill_s
    if plain or (choice is not None and not choice.pays):
        return prefill, new_tokens * costs.decode(context)
    if choice is None:
        return None
    n = 1 + choice.tree.total_tokens
    shift = costs.verify_at(context, n) - costs.verify_at(sum(costs.contexts) / 2, n)  # choose() took the mean
    return prefill + prompt_tokens * costs.prompt_rows_s, new_tokens / choice.tau * (choice.round_s + shift)


class Pacer:
    """Whether to speculate now: speculation runs while its observed tokens per second beat the baseline's.

    Both rates start at the cost model's predictions (`Choice`) and follow what is observed, as exponentially
    weighted sums of tokens and seconds (`weight` per observation), so that a mispredicted drafter or overheads
    the cost model missed are noticed within about 1 / `weight` rounds. The tokens a round gains are noisy (1 to
    depth + 1, in runs): at weight 0.3, with the verdict carried from one reply to the next, two or three unlucky
    rounds dropped drafters that paid (`tests/test_budget.py` replays a drafter gaining 2.6 tokens a round: 1.00x
    kept of the 1.32x that always speculating gives; at 0.1 with `restart`, 1.31x, and one that loses is still
    dropped). The two modes are never observed at the same time,
    and a machine (or a server) whose load changes slows whichever runs now: compared as observed, a fresh round
    under a new load would lose against a baseline rate observed before it, and the verdict would flap with the
    load. So each observation's time in the target's forwards counts at what the cost model predicted for them
    (`observe`): the rates compare the tokens per round and the time outside the target, which the load does
    not change. While the baseline runs, one speculative round is tried after every `probe_after`
    baseline tokens, so that speculation comes back when it pays again. `pays` is the current belief; callers say
    so when it changes. Within a generation the verdict has a band: speculation is dropped only once it is slower
    by `drop_margin`, and taken back only once it leads by `margin`. A drop lasts the rest of a reply (the next
    probe comes after more tokens than most replies have; an edge hands the reply to the server), and a drafter
    that pays by a little often averages below break-even over ten unlucky rounds (replayed in
    `tests/test_budget.py`: one gaining 1.23x always speculating keeps 1.23x with the band, 1.18x without); one
    lucky probe round does not bring it back either. Each new generation is judged afresh at the drafter's
    long-run rate, without the band (`restart`).

    Counting the target at its predicted cost trusts the start-up timing of a verify round against a decode
    step; a load spike while it was timed would misjudge every round after it. So the Pacer re-times them side by
    side: whenever a round of one mode directly follows one of the other, both ran under about the same load, and
    the ratio of their observed-to-predicted target times corrects the verify round's predicted cost
    (`verify_scale`, a running geometric mean with weight `retime_weight`). Probes make such pairs while the
    baseline runs; while speculating, `retime_after` (None: never) makes every so many rounds a baseline step."""

    def __init__(self, choice: Choice, weight: float = 0.1, probe_after: int = 256, margin: float = 0.1,
                 drop_margin: float = 0.15, retime_after: int | None = None, retime_weight: float = 0.3,
                 prior_rounds: int = 32):
        self.weight, self.probe_after, self.margin, self.drop_margin = weight, probe_after, margin, drop_margin
        self.retime_after, self.retime_weight, self.prior_rounds = retime_after, retime_weight, prior_rounds
        self._base = [1.0, choice.baseline_s]  # weighted tokens, seconds
        self.retarget(choice)
        self._since_probe = 0
        self._rounds = 0  # speculative rounds since the last baseline step
        self._last: tuple[bool, float] | None = None  # the last observation's mode and observed/predicted target
        self.verify_scale = 1.0  # a verify round's target time as re-timed, over its predicted time

    def retarget(self, choice: Choice) -> None:
        """Speculate with `choice`'s budget from now on (`TreeTuner`): speculation's tokens and seconds per round,
        and its long-run tokens per round, start again at its prediction; the baseline and the re-timing stay."""
        self._spec = [choice.tau, choice.round_s]  # weighted tokens, seconds
        self._accepted = [choice.tau * self.prior_rounds, float(self.prior_rounds)]  # all rounds' tokens, rounds
        spec, base = self.rates()
        self.pays = spec >= base

    def rates(self) -> tuple[float, float]:
        """Current estimates: speculative and baseline tokens per second (with the target as fast as measured)."""
        return self._spec[0] / self._spec[1], self._base[0] / self._base[1]

    def restart(self) -> None:
        """A new generation (a new prompt). How many drafted tokens are accepted depends on the text being written,
        and a few poor rounds at the end of one reply say little about the next. So speculation's tokens per round
        go back to their long-run mean (every speculative round so far, the prediction counting as `prior_rounds`
        of them) and the verdict is taken again; the seconds per round, the baseline's rate and the re-timing,
        which are about the machine, stay."""
        self._spec[0] = self._accepted[0] / self._accepted[1]
        spec, base = self.rates()
        self.pays = spec >= base

    def observe(self, speculative: bool, tokens: int, seconds: float, target_s: float = 0.0,
                predicted_target_s: float | None = None) -> None:
        """A round (or a stretch of baseline decoding) made `tokens` in `seconds`, `target_s` of them in target
        forwards that the cost model predicted to take `predicted_target_s` (None: count the seconds as they
        are)."""
        if predicted_target_s is not None:
            if target_s > 0 and predicted_target_s > 0:
                self._retime(speculative, target_s / predicted_target_s)
            seconds += predicted_target_s * (self.verify_scale if speculative else 1.0) - target_s
        if speculative:
            self._accepted[0] += tokens
            self._accepted[1] += 1
        acc = self._spec if speculative else self._base
        acc[0] += self.weight * (tokens - acc[0])
        acc[1] += self.weight * (seconds - acc[1])
        self._since_probe = 0 if speculative else self._since_probe + tokens
        self._rounds = self._rounds + 1 if speculative else 0
        spec, base = self.rates()
        self.pays = spec >= base * (1 - self.drop_margin) if self.pays else spec > base * (1 + self.margin)

    def _retime(self, speculative: bool, ratio: float) -> None:
        """A round whose target time was `ratio` x its prediction; next to one of the other mode, a re-timing."""
        if self._last is not None and self._last[0] != speculative:
            verify, decode = (ratio, self._last[1]) if speculative else (self._last[1], ratio)
            pair = min(max(verify / decode, 0.25), 4.0)  # one odd pair moves the scale a bounded step
            self.verify_scale *= (pair / self.verify_scale) ** self.retime_weight
        self._last = (speculative, ratio)

    def speculate(self) -> bool:
        """Speculate next (it pays, or a probe is due) or run the baseline (a re-timing step, when due)."""
        if self.pays and self.retime_after is not None and self._rounds >= self.retime_after:
            return False
        return self.pays or self._since_probe >= self.probe_after


class Forecast:
    """Seconds the next generation will take: its prefill (per prompt token) and its new tokens (per token).

    Both start at the cost model's prediction, `prior(prompt_tokens, new_tokens) -> (prefill_s, generation_s)` or
    None, and once `min_tokens` of each have been observed they follow what earlier generations took (sums that
    decay by `decay` per generation, so a machine whose load changes is followed within a few generations). What
    rounds cost beyond the timed forwards (sampling, the stop rule, Python, a busy machine) is then included.
    Compare a forecast made before a generation with what it took (`copy` it first)."""

    def __init__(self, prior: Callable[[int, int], tuple[float, float] | None], decay: float = 0.5,
                 min_tokens: int = 32):
        self.prior, self.decay, self.min_tokens = prior, decay, min_tokens
        self._seen = [0.0, 0.0, 0.0, 0.0]  # prompt tokens, prefill seconds, new tokens, generation seconds

    def seconds(self, prompt_tokens: int, new_tokens: int) -> float | None:
        """Predicted seconds of a generation (None: no prior and too little observed)."""
        prompt, prefill_s, new, generation_s = self._seen
        prior = self.prior(prompt_tokens, new_tokens)
        prefill = prompt_tokens * prefill_s / prompt if prompt >= self.min_tokens else prior and prior[0]
        generation = new_tokens * generation_s / new if new >= self.min_tokens else prior and prior[1]
        return None if prefill is None or generation is None else prefill + generation

    def observe(self, prompt_tokens: int, prefill_s: float, new_tokens: int, generation_s: float) -> None:
        self._seen = [self.decay * x + y for x, y in zip(self._seen, (prompt_tokens, prefill_s, new_tokens,
                                                                     generation_s))]

    def copy(self) -> "Forecast":
        out = Forecast(self.prior, self.decay, self.min_tokens)
        out._seen = list(self._seen)
        return out
