"""Single-device speculative decoding: drafter and target in one PyTorch process.

`SpeculativeEngine(target, drafter).generate(...)` drafts an EAGLE-2 dynamic tree with the drafter (the shared
numpy `DraftSession`), verifies it with one target forward (`models.verify`), keeps the accepted path in every
cache and adds memory rows for the verified tokens. `drafter=None` is vanilla decoding. The API follows Hugging
Face `generate`: prompt or chat messages, max_new_tokens, temperature, top_p, top_k, stop strings, a streamer.
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Protocol, runtime_checkable

import numpy as np
import torch

from moa_core.budget import WIDTHS, Choice, Costs, Forecast, Pacer, TreeTuner, measure_draft, prior_s
from moa_core.drafting import DraftSession, DraftStep
from moa_core.generation import Prompt, StopRule, encode_prompt
from moa_core.lookup import COPY_TOKENS, copy_chain
from moa_core.tree import DraftTree, TreeConfig
from models.drafter import Drafter
from models.moa import extend
from models.lookup import chain_tree
from models.target import Target, TargetRunner, TargetStep, bf16_supported
from models.verify import Sampling, sample_token, verify_tree

log = logging.getLogger("moa.engine")
RETIME_AFTER = 32  # while speculation pays, every so many rounds one plain step re-times it (`Pacer`)


class TorchDraftStep:
    """A PyTorch drafter behind the numpy `DraftStep` interface of `DraftSession`; with `dtype`, a copy of the
    drafter in that dtype (drafts need no exact numerics: the target verifies every token)."""

    def __init__(self, drafter: Drafter, dtype: torch.dtype | None = None):
        if dtype is not None and dtype != next(drafter.parameters()).dtype:
            drafter = copy.deepcopy(drafter).to(dtype)
        self.drafter = drafter.eval()
        self.arch = drafter.arch
        self.keeps_draft_cache = drafter.keeps_draft_cache
        self.cache_shape = drafter.cache_shape()
        self.draft_vocab = None if drafter.draft_vocab is None else drafter.draft_vocab.cpu().numpy()
        self.vocab_size = drafter.lm_head.weight.shape[0]
        p = next(drafter.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.tli = drafter.tli_layers
        self.runner: TargetRunner | None = None  # TLI: the target cache of the sequence being drafted (`follow`)
        self._drafted: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # TLI K/V of this round's draft slots

    def follow(self, runner: TargetRunner | None) -> None:
        """Draft for the sequence whose target cache `runner` holds (what a TLI drafter's last layers read)."""
        self.runner, self._drafted = runner, None

    def _tli_past(self, slots: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per TLI layer the K/V of the first max(slots, verified) cache slots: the target's cache of the verified
        tokens, then the K/V the TLI layers added for this round's draft slots in the calls before. Without a runner
        (measuring the draft step's cost) every slot holds zeros."""
        if self.runner is None:
            h, d = self.drafter.tli.kv_heads, self.drafter.tli.layers[0].self_attn.head_dim
            zeros = torch.zeros(1, h, slots, d, device=self.device, dtype=self.dtype)
            return [(zeros, zeros)] * self.tli
        verified = self.runner.length
        past = [(layer.keys[:, :, :verified], layer.values[:, :, :verified])
                for layer in self.runner.cache.layers[-self.tli:]]
        if slots <= verified:
            return past
        if self._drafted is None or self._drafted[0][0].shape[2] != slots - verified:
            raise RuntimeError(f"TLI: {slots - verified} draft slots past the target's cache, but "
                               f"{0 if self._drafted is None else self._drafted[0][0].shape[2]} kept")
        return extend(past, self._drafted)

    def _t(self, x: np.ndarray | None, dtype=None) -> torch.Tensor | None:
        if x is None:
            return None
        return torch.from_numpy(np.ascontiguousarray(x)).to(self.device, dtype or self.dtype).unsqueeze(0)

    @torch.no_grad()
    def __call__(self, ids, positions, past_k, past_v, mask, memory, features):
        tli = {}
        if self.tli:
            slots = past_k.shape[1]
            tli["tli_past"] = self._tli_past(slots)
        out = self.drafter.draft_step(
            self._t(ids, torch.long), self._t(positions, torch.long), self._t(past_k), self._t(past_v),
            self._t(mask).unsqueeze(0), memory=self._t(memory), features=self._t(features), **tli)
        if self.tli and self.runner is not None:
            drafted = slots > self.runner.length
            self._drafted = extend(self._drafted, out.tli_kv) if drafted else out.tli_kv
        return tuple(x[0].float().cpu().numpy() for x in (out.logits, out.features, out.keys, out.values))

    @torch.no_grad()
    def memory_rows(self, step: TargetStep, positions: list[int]) -> np.ndarray:
        batched = TargetStep(None, step.hidden.unsqueeze(0), step.keys.unsqueeze(0), step.values.unsqueeze(0))
        pos = torch.tensor(positions, device=self.device).view(1, -1)
        return self.drafter.memory_rows(batched, pos)[0].float().cpu().numpy()


def drafting_dtype(precision: str, drafter: Drafter | None) -> torch.dtype | None:
    """The dtype a PyTorch draft step runs in for `precision` (auto | bf16 | fp32); None keeps the drafter's."""
    if precision not in ("auto", "bf16", "fp32"):
        raise ValueError(f"draft_precision must be auto, bf16 or fp32, got {precision!r}")
    if drafter is None or precision == "fp32":
        return None
    p = next(drafter.parameters())
    use = precision == "bf16" or (p.dtype == torch.float32 and bf16_supported(p.device))
    return torch.bfloat16 if use else None


@dataclass
class GenerationStats:
    new_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens continued from a target cache (`generate(runner=...)`), not prefilled
    target_forwards: int = 0
    drafter_calls: int = 0
    acceptance_lengths: list[int] = field(default_factory=list)  # tokens gained per target forward (bonus incl.)
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0
    tree: str = ""
    plain_rounds: int = 0  # rounds decoded plainly because speculation did not pay (tree auto)
    copy_rounds: int = 0  # rounds with a copy chain (copy_tokens): the drafter's tree and the chain, or the chain
    predicted_s: float | None = None  # what the forecast predicted before the generation (for its new_tokens)

    @property
    def tau(self) -> float:
        return float(np.mean(self.acceptance_lengths)) if self.acceptance_lengths else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "tau": self.tau, "tokens_per_s": self.tokens_per_s}


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    stats: GenerationStats
    finish_reason: str  # "eos" | "stop" | "length"


@runtime_checkable
class Proposer(Protocol):
    """A training-free drafter (e.g. `models.lookup.PromptLookup`): drafts from the transcript alone."""

    default_tree: TreeConfig  # the budget `tree="auto"` means

    def propose(self, transcript: list[int], cfg: TreeConfig) -> DraftTree:
        """A draft tree below the root, the transcript's last token."""


class SpeculativeEngine:
    """Speculative (or vanilla) generation on one device.

    With `tree="auto"` the budget comes from the cost model (models/costmodel.py), and a `Pacer` decides round by
    round whether speculation pays: when it is predicted or observed not to, the engine decodes plainly (one
    target forward per token), tries a speculative round again now and then, and says when the verdict changes;
    each generation starts from the drafter's long-run acceptance (`Pacer.restart`: it depends on the prompt), with
    the tree chosen again from the tokens the rounds gained so far (`TreeTuner`); while
    speculating, one round in RETIME_AFTER decodes plainly, so that a verify round and a decode step are
    re-timed side by side, under the same load (a start-up timing thrown off by a load spike is corrected).
    `predict_s` is what a generation is expected to take: the cost model's figures, refreshed by the generations
    observed since (`Forecast`); once the costs are measured each result's stats carry the prediction made before
    it (`predicted_s`).
    `copy_tokens` > 0 (0 = off; default COPY_TOKENS with a neural drafter, 0 without): when the transcript's last
    tokens occurred before, the tokens that followed them (up to copy_tokens, prompt lookup's proposal) are verified
    too, grafted onto the drafter's tree, or alone where the engine decodes plainly (always, without a drafter);
    such rounds are decided by the match, so the Pacer judges the drafter on the other rounds only. Under greedy
    decoding a copy alone pays (it follows a 2- or 3-token match: 4.8 tokens accepted on average on the target's
    held-out answers, where a verify of 17 tokens costs about 2 decode steps on a CPU and about 1 on a GPU); under
    sampling it is accepted less, and a Pacer of its own judges those rounds against plain decoding."""

    def __init__(self, target: Target, drafter: Drafter | Proposer | str | None = None,
                 tree: TreeConfig | str = "auto", candidates: int = 16, draft_step: DraftStep | None = None,
                 batcher=None, copy_tokens: int | None = None, costs: Costs | None = None,
                 draft_precision: str = "auto"):
        """`drafter`: a neural drafter, a `Proposer`, "lookup" (prompt lookup) or None (vanilla decoding).
        `draft_step`: what drafts for a neural drafter (default: the drafter itself in PyTorch; e.g. its ONNX
        Runtime graph); the drafter's memory head computes the memory rows either way. `draft_precision` of the
        default draft step: fp32, bf16, or auto (bf16 where the hardware has bf16 matmuls: on a CPU with AMX a draft
        step takes about half the time; the target verifies in its own dtype, so output is unchanged). `batcher`
        (models.batching.Batcher): target forwards join those of concurrent generations (the server). `costs`:
        the cost model when already measured for this target (else measured on first use)."""
        if drafter == "lookup":
            from models.lookup import PromptLookup

            drafter = PromptLookup()
        self.target = target
        self.batcher = batcher
        self.proposer = drafter if isinstance(drafter, Proposer) else None
        self.drafter = None if self.proposer is not None else drafter
        self.memory_head = TorchDraftStep(self.drafter) if self.drafter is not None else None
        self.step = draft_step or (TorchDraftStep(self.drafter, drafting_dtype(draft_precision, self.drafter))
                                   if self.drafter is not None else None)
        self.candidates = candidates
        self.copy_tokens = self._copy_tokens(COPY_TOKENS if self.drafter is not None and copy_tokens is None
                                             else copy_tokens or 0)
        if self.drafter is not None and self.drafter.target_fingerprint != target.weights_fingerprint:
            raise ValueError("drafter and target fingerprints differ")
        self._costs: Costs | None = costs
        self._copy_pacer: Pacer | None = None
        self._draft_s: dict[int, float] | None = None
        self.tuner: TreeTuner | None = None  # tree auto with a neural drafter: chooses the tree between generations
        self.pacer: Pacer | None = None
        if tree == "auto" and drafter is not None:
            if self.proposer is not None:
                tree = self.proposer.default_tree
                # no acceptance record: start from an optimistic prior (every draft accepted) and let rounds tell
                prior = self.round_s(tree, 1 + tree.depth, self.costs.contexts[0])
                self.pacer = Pacer(Choice(tree, 1 + tree.depth, prior, self.costs.decode(self.costs.contexts[0])),
                                   retime_after=RETIME_AFTER)
            else:
                from models.costmodel import auto_tree

                self.tuner = auto_tree(self)
                tree = self.choice.tree
                self.pacer = Pacer(self.choice, retime_after=RETIME_AFTER)
        self._said = self.pacer.pays if self.pacer else True  # the pacer's verdict last said
        self._warned = False  # the first verdict change is said as a warning, later ones (each prompt may flip it) as info
        self.forecast = Forecast(self.prior_s)
        self.tree = tree if isinstance(tree, TreeConfig) else TreeConfig.parse(tree) if drafter else None

    @property
    def choice(self) -> Choice | None:
        """The cost model's prediction for the current tree (tree auto with a neural drafter)."""
        return self.tuner.choice if self.tuner is not None else None

    @property
    def costs(self) -> Costs:
        """What rounds cost with this target and memory head on this machine (measured on first use)."""
        if self._costs is None:
            from models.costmodel import measure_costs

            self._costs = measure_costs(self.target, self.memory_head)
        return self._costs

    def measure_costs(self) -> Costs:
        """Measure the cost model now rather than on first use (a benchmark: every generation is then predicted
        before it runs)."""
        return self.costs

    @property
    def draft_s(self) -> dict[int, float]:
        """Seconds of one draft step by frontier width (0 for a proposer, measured on first use for a drafter)."""
        if self._draft_s is None:
            self._draft_s = (measure_draft(self.step, self.drafter.row_width, self.target.spec.hidden_size)
                             if self.step is not None else {w: 0.0 for w in WIDTHS})
        return self._draft_s

    def round_s(self, tree: TreeConfig, tau: float, context: float) -> float:
        """Predicted seconds of one speculative round of `tree` gaining `tau` tokens at `context`."""
        draft = self.draft_s
        frontier = float(np.interp(tree.topk, WIDTHS, [draft[w] for w in WIDTHS]))
        return draft[1] + (tree.depth - 1) * frontier + self.costs.round_target_s(context, 1 + tree.total_tokens, tau)

    def prior_s(self, prompt_tokens: int, new_tokens: int) -> tuple[float, float] | None:
        """What the cost model, from what it measured at start, predicts a generation costs (moa_core.budget's
        `prior_s`)."""
        return prior_s(self.costs, self.choice, prompt_tokens, new_tokens, plain=self.tree is None)

    def predict_s(self, prompt_tokens: int, new_tokens: int) -> float | None:
        """Seconds the next generation is predicted to take (`forecast`: the cost model, refreshed by the
        generations observed since)."""
        return self.forecast.seconds(prompt_tokens, new_tokens)

    def copy_pacer(self, copy_tokens: int) -> Pacer:
        """Whether rounds of a copy alone pay under sampling. The prior is modest (2 tokens accepted after the root;
        greedy decoding gets 2.0 after a 2-token match, 5.8 after a 3-token one: `python -m models.lookup`), and
        the observed rounds correct it with a long memory (a copy is mostly all or nothing), trying again after
        64 plain tokens once it stopped paying."""
        if self._copy_pacer is None:
            context, tau = self.costs.contexts[0], 1 + 2.0
            chain = TreeConfig(copy_tokens, 1, copy_tokens)
            self._copy_pacer = Pacer(Choice(chain, tau, self.costs.round_target_s(context, 1 + copy_tokens, tau),
                                            self.costs.decode(context)), weight=0.1, probe_after=64)
        return self._copy_pacer

    def _copy_tokens(self, n: int) -> int:
        if n < 0 or (n and self.proposer is not None):
            raise ValueError(f"copy_tokens must be >= 0 (0 with a proposer such as prompt lookup), got {n}")
        return n

    def encode(self, prompt: Prompt) -> list[int]:
        return encode_prompt(prompt, self.target.encode_chat)

    @torch.no_grad()
    def generate(
        self,
        prompt: Prompt,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        stop: list[str] | None = None,
        streamer: Callable[[str], None] | None = None,
        seed: int | None = None,
        copy_tokens: int | None = None,
        runner: TargetRunner | None = None,
        token_streamer: Callable[[str, list[int]], None] | None = None,
    ) -> GenerationResult:
        """`streamer` gets the new text after every round, `token_streamer` the new text and the new token ids (the
        server streams both); `copy_tokens`: this generation's longest copy chain (default: the engine's). `runner`: a target cache that already holds a prefix of the
        prompt, continued instead of prefilling it again (plain decoding only: a drafter needs the whole prompt's
        activations); the caller checks that it is a prefix, and gets it back grown by this generation."""
        if runner is not None and self.step is not None:
            raise ValueError("a target cache to continue serves plain decoding only, not a drafter")
        copy_tokens = self.copy_tokens if copy_tokens is None else self._copy_tokens(copy_tokens)
        sampling = Sampling(temperature, top_k, top_p)
        g = torch.Generator(device=self.target.device)
        g.manual_seed(seed if seed is not None else int(time.time_ns() % 2**31))
        rng = np.random.default_rng(seed)
        checker = StopRule(self.target.eos_token_ids, self.target.tokenizer.decode, stop)
        if self.tuner is not None and (note := self.tuner.retune(self.pacer)):
            log.info(note)
            self.tree = self.choice.tree
        if self.pacer is not None:
            self.pacer.restart()  # whether drafts are accepted depends on the prompt: the verdict is taken again
        forecast = self.forecast.copy()  # what was predicted before this generation
        stats = GenerationStats(tree=str(self.tree) if self.tree else "none")
        ids = self.encode(prompt)
        t0 = time.perf_counter()
        if runner is None:
            runner = self.target.new_runner(self.batcher)
        runner.crop(min(runner.length, len(ids) - 1))  # at least the prompt's last token is forwarded, for its logits
        cached = stats.cached_tokens = runner.length
        step = runner.forward(ids[cached:], logits="last")
        stats.target_forwards += 1
        root = sample_token(step.logits[-1], sampling, g)
        prefill_s = time.perf_counter() - t0
        session = DraftSession(self.step, self.candidates) if self.step is not None else None
        if isinstance(self.step, TorchDraftStep):
            self.step.follow(runner)
        behind: list[tuple[list[int], TargetStep]] = [(ids, step)] if session else []  # verified, not yet in session
        out: list[int] = []
        printed = sent = 0  # characters and tokens streamed
        reason = None
        while reason is None:
            speculate = self.tree is not None and (self.pacer is None or self.pacer.speculate())
            if speculate and session is not None and behind:
                # the rows of the prompt or of plain rounds: owed by those tokens, not by this round (in the Pacer,
                # a probe after 256 plain tokens would look too slow to ever bring speculation back)
                self._catch_up(session, behind)
            t, target_s, context = time.perf_counter(), stats.verify_s, len(ids) + len(out)
            copy = copy_chain(ids + out + [root], copy_tokens) if copy_tokens else []
            if copy and not speculate and not sampling.greedy and not self.copy_pacer(copy_tokens).speculate():
                copy = []  # rounds of a copy alone do not pay now: decode plainly
            stats.copy_rounds += bool(copy)
            if speculate:
                new, root, size = self._speculative_round(runner, session, ids + out, root, sampling, g, rng, stats,
                                                          copy)
            elif copy:  # the copy alone: the drafter's session catches up later, as after plain rounds
                new, root, step = self._copy_round(runner, root, copy, sampling, g, stats)
                if session is not None:
                    behind.append((new, step))
            else:
                new, root, step = self._vanilla_round(runner, root, sampling, g, stats)
                if session is not None:
                    behind.append((new, step))
                stats.plain_rounds += self.tree is not None
            if self._copy_pacer is not None and not speculate and not sampling.greedy:  # a copy alone, or plain
                self._copy_pacer.observe(bool(copy), len(new), time.perf_counter() - t, stats.verify_s - target_s,
                                         self.costs.round_target_s(context, 1 + len(copy), len(new)) if copy
                                         else self.costs.decode(context))
            if self.pacer is not None and not copy:
                predicted = (self.costs.round_target_s(context, size, len(new)) if speculate
                             else self.costs.decode(context))
                if speculate and self.tuner is not None:
                    self.tuner.observe(self.tree, len(new))
                self.pacer.observe(speculate, len(new), time.perf_counter() - t, stats.verify_s - target_s, predicted)
                if self.pacer.pays != self._said:
                    self._said = self.pacer.pays
                    spec, base = self.pacer.rates()
                    log.log(logging.INFO if self._warned else logging.WARNING,
                            "tree auto: speculation %s (%.1f tokens/s vs %.1f decoding plainly, as observed with the "
                            "target at its measured speed): %s", "pays again" if self.pacer.pays else "does not pay",
                            spec, base, "speculating" if self.pacer.pays else "decoding plainly, trying again now "
                            "and then, and at the next prompt")
                    self._warned = True
            stats.acceptance_lengths.append(len(new))
            out, reason = checker.cut(out + new, max_new_tokens)
            if streamer is not None or token_streamer is not None:
                text = self.target.tokenizer.decode(out, skip_special_tokens=True)
                if streamer is not None:
                    streamer(text[printed:])
                if token_streamer is not None:
                    token_streamer(text[printed:], out[sent:])
                printed, sent = len(text), len(out)
        stats.new_tokens = len(out)
        stats.total_s = time.perf_counter() - t0
        if self._costs is not None:  # measured (tree auto, or asked for): predictions are wanted
            stats.predicted_s = forecast.seconds(len(ids) - cached, stats.new_tokens)
        self.forecast.observe(len(ids) - cached, prefill_s, stats.new_tokens, stats.total_s - prefill_s)
        if session is not None:
            stats.drafter_calls = session.stats.drafter_calls
        return GenerationResult(self.target.tokenizer.decode(out, skip_special_tokens=True), out, stats, reason)

    def _vanilla_round(self, runner: TargetRunner, root: int, sampling, g, stats) -> tuple[list[int], int, TargetStep]:
        t = time.perf_counter()
        step = runner.forward([root])
        stats.verify_s += time.perf_counter() - t
        stats.target_forwards += 1
        return [root], sample_token(step.logits[-1], sampling, g), step

    def _copy_round(self, runner: TargetRunner, root: int, copy: list[int], sampling, g,
                    stats) -> tuple[list[int], int, TargetStep]:
        """Verify the copy chain alone (one-hot draft distributions: sampling accepts a token with probability p)."""
        t = time.perf_counter()
        verified = verify_tree(runner, root, chain_tree(copy), sampling, g)
        stats.verify_s += time.perf_counter() - t
        stats.target_forwards += 1
        return [root] + verified.accepted, verified.next_token, verified.step

    def _catch_up(self, session: DraftSession, behind: list[tuple[list[int], TargetStep]]) -> None:
        """Give the drafter's session the tokens verified without it (the prompt, plainly decoded ones) and their
        memory rows, computed in one call."""
        tokens = [t for chunk, _ in behind for t in chunk]
        step = TargetStep(None, torch.cat([s.hidden for _, s in behind]), torch.cat([s.keys for _, s in behind], 1),
                          torch.cat([s.values for _, s in behind], 1))
        base = len(session.tokens)
        session.add_verified(tokens, self.memory_head.memory_rows(step, list(range(base, base + len(tokens)))))
        behind.clear()

    def _speculative_round(self, runner, session: DraftSession | None, context: list[int], root: int, sampling, g,
                           rng, stats, copy: list[int]):
        """Draft (with the drafter's session and the `copy` chain, or the proposer from `context` + root), verify,
        keep the path: the new tokens, the next root and the number of tokens verified."""
        t = time.perf_counter()
        if session is None:
            tree: DraftTree = self.proposer.propose(context + [root], self.tree)
        else:
            tree = session.draft(root, self.tree, sampling.temperature, rng, copy)
        t1 = time.perf_counter()
        verified = verify_tree(runner, root, tree, sampling, g)
        if session is not None:
            base = len(session.tokens)
            rows = self.memory_head.memory_rows(verified.step, list(range(base, base + 1 + len(verified.path))))
            session.accept(tree, root, verified.path, rows)
        t2 = time.perf_counter()
        stats.draft_s += t1 - t
        stats.verify_s += t2 - t1
        stats.target_forwards += 1
        return [root] + verified.accepted, verified.next_token, 1 + len(tree.tokens)
