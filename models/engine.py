"""Single-device speculative decoding: drafter and target in one PyTorch process.

`SpeculativeEngine(target, drafter).generate(...)` drafts an EAGLE-2 dynamic tree with the drafter (the shared
numpy `DraftSession`), verifies it with one target forward (`models.verify`), keeps the accepted path in every
cache and adds memory rows for the verified tokens. `drafter=None` is vanilla decoding. The API follows Hugging
Face `generate`: prompt or chat messages, max_new_tokens, temperature, top_p, top_k, stop strings, a streamer.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Protocol, runtime_checkable

import numpy as np
import torch

from edge_client.drafting import DraftSession
from edge_client.tree import DraftTree, TreeConfig
from models.drafter import Drafter
from models.target import Target, TargetRunner, TargetStep
from models.verify import Sampling, sample_token, verify_tree


class TorchDraftStep:
    """A PyTorch drafter behind the numpy `DraftStep` interface of `DraftSession`."""

    def __init__(self, drafter: Drafter):
        self.drafter = drafter.eval()
        self.arch = drafter.arch
        self.keeps_draft_cache = drafter.keeps_draft_cache
        self.cache_shape = drafter.cache_shape()
        p = next(drafter.parameters())
        self.device, self.dtype = p.device, p.dtype

    def _t(self, x: np.ndarray | None, dtype=None) -> torch.Tensor | None:
        if x is None:
            return None
        return torch.from_numpy(np.ascontiguousarray(x)).to(self.device, dtype or self.dtype).unsqueeze(0)

    @torch.no_grad()
    def __call__(self, ids, positions, past_k, past_v, mask, memory, features):
        out = self.drafter.draft_step(
            self._t(ids, torch.long), self._t(positions, torch.long), self._t(past_k), self._t(past_v),
            self._t(mask).unsqueeze(0), memory=self._t(memory), features=self._t(features))
        return tuple(x[0].float().cpu().numpy() for x in (out.logits, out.features, out.keys, out.values))

    @torch.no_grad()
    def memory_rows(self, step: TargetStep, positions: list[int]) -> np.ndarray:
        batched = TargetStep(None, step.hidden.unsqueeze(0), step.keys.unsqueeze(0), step.values.unsqueeze(0))
        pos = torch.tensor(positions, device=self.device).view(1, -1)
        return self.drafter.memory_rows(batched, pos)[0].float().cpu().numpy()


@dataclass
class GenerationStats:
    new_tokens: int = 0
    target_forwards: int = 0
    drafter_calls: int = 0
    acceptance_lengths: list[int] = field(default_factory=list)  # tokens gained per target forward (bonus incl.)
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0
    tree: str = ""

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


class StopChecker:
    """Finds EOS tokens and stop strings in the tokens produced so far."""

    def __init__(self, target: Target, stop: list[str] | None):
        self.tokenizer = target.tokenizer
        self.eos = target.eos_token_ids
        self.stop = stop or []

    def cut(self, tokens: list[int], max_new: int) -> tuple[list[int], str | None]:
        """Tokens to keep, and why generation ends (None: go on)."""
        for i, t in enumerate(tokens[:max_new]):
            if t in self.eos:
                return tokens[: i + 1], "eos"
        if self.stop:
            text = self.tokenizer.decode(tokens[:max_new])
            for s in self.stop:
                if s in text:
                    for i in range(1, len(tokens) + 1):  # the shortest prefix that contains the stop string
                        if s in self.tokenizer.decode(tokens[:i]):
                            return tokens[:i], "stop"
        if len(tokens) >= max_new:
            return tokens[:max_new], "length"
        return tokens, None


@runtime_checkable
class Proposer(Protocol):
    """A training-free drafter (e.g. `models.lookup.PromptLookup`): drafts from the transcript alone."""

    default_tree: TreeConfig  # the budget `tree="auto"` means

    def propose(self, transcript: list[int], cfg: TreeConfig) -> DraftTree:
        """A draft tree below the root, the transcript's last token."""


class SpeculativeEngine:
    def __init__(self, target: Target, drafter: Drafter | Proposer | str | None = None,
                 tree: TreeConfig | str = "auto", candidates: int = 16):
        """`drafter`: a neural drafter, a `Proposer`, "lookup" (prompt lookup) or None (vanilla decoding)."""
        if drafter == "lookup":
            from models.lookup import PromptLookup

            drafter = PromptLookup()
        self.target = target
        self.proposer = drafter if isinstance(drafter, Proposer) else None
        self.drafter = None if self.proposer is not None else drafter
        self.step = TorchDraftStep(self.drafter) if self.drafter is not None else None
        self.candidates = candidates
        if self.drafter is not None and self.drafter.target_fingerprint != target.weights_fingerprint:
            raise ValueError("drafter and target fingerprints differ")
        if tree == "auto" and drafter is not None:
            if self.proposer is not None:
                tree = self.proposer.default_tree
            else:
                from models.costmodel import auto_tree

                tree = auto_tree(self)
        self.tree = tree if isinstance(tree, TreeConfig) else TreeConfig.parse(tree) if drafter else None

    def encode(self, prompt: str | list[dict] | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.target.encode_chat([{"role": "user", "content": prompt}])
        if prompt and isinstance(prompt[0], dict):
            return self.target.encode_chat(prompt)
        return list(prompt)

    @torch.no_grad()
    def generate(
        self,
        prompt: str | list[dict] | list[int],
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        stop: list[str] | None = None,
        streamer: Callable[[str], None] | None = None,
        seed: int | None = None,
    ) -> GenerationResult:
        sampling = Sampling(temperature, top_k, top_p)
        g = torch.Generator(device=self.target.device)
        g.manual_seed(seed if seed is not None else int(time.time_ns() % 2**31))
        rng = np.random.default_rng(seed)
        stats = GenerationStats(tree=str(self.tree) if self.tree else "none")
        checker = StopChecker(self.target, stop)
        ids = self.encode(prompt)
        t0 = time.perf_counter()
        runner = self.target.new_runner()
        step = runner.forward(ids, logits="last")
        stats.target_forwards += 1
        root = sample_token(step.logits[-1], sampling, g)
        session = None
        if self.step is not None:
            session = DraftSession(self.step, self.candidates)
            session.add_verified(ids, self.step.memory_rows(step, list(range(len(ids)))))
        out: list[int] = []
        printed = 0
        reason = None
        while reason is None:
            if self.tree is None:
                new, root = self._vanilla_round(runner, root, sampling, g, stats)
            else:
                new, root = self._speculative_round(runner, session, ids + out, root, sampling, g, rng, stats)
            stats.acceptance_lengths.append(len(new))
            out, reason = checker.cut(out + new, max_new_tokens)
            if streamer is not None:
                text = self.target.tokenizer.decode(out, skip_special_tokens=True)
                streamer(text[printed:])
                printed = len(text)
        stats.new_tokens = len(out)
        stats.total_s = time.perf_counter() - t0
        if session is not None:
            stats.drafter_calls = session.stats.drafter_calls
        return GenerationResult(self.target.tokenizer.decode(out, skip_special_tokens=True), out, stats, reason)

    def _vanilla_round(self, runner: TargetRunner, root: int, sampling, g, stats) -> tuple[list[int], int]:
        t = time.perf_counter()
        step = runner.forward([root])
        stats.verify_s += time.perf_counter() - t
        stats.target_forwards += 1
        return [root], sample_token(step.logits[-1], sampling, g)

    def _speculative_round(self, runner, session: DraftSession | None, context: list[int], root: int, sampling, g,
                           rng, stats):
        """Draft (with the drafter's session, or the proposer from `context` + root), verify, keep the path."""
        t = time.perf_counter()
        if session is None:
            tree: DraftTree = self.proposer.propose(context + [root], self.tree)
        else:
            tree = session.draft(root, self.tree, sampling.temperature, rng)
        t1 = time.perf_counter()
        verified = verify_tree(runner, root, tree, sampling, g)
        if session is not None:
            base = len(session.tokens)
            rows = self.step.memory_rows(verified.step, list(range(base, base + 1 + len(verified.path))))
            session.accept(tree, root, verified.path, rows)
        t2 = time.perf_counter()
        stats.draft_s += t1 - t
        stats.verify_s += t2 - t1
        stats.target_forwards += 1
        return [root] + verified.accepted, verified.next_token
