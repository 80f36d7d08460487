"""The drafter's side of speculative decoding, in numpy: one `DraftSession` per sequence, shared by the PyTorch
engine and the ONNX Runtime edge so that both draft exactly the same trees.

The session owns the drafter's self-attention cache (slots 0..T-1 hold verified tokens, in position order) and
the memory rows of verified tokens. A round: `draft(root)` runs the pending verified tokens and the root through
the drafter, grows the tree (tree-node entries go to extra cache slots), and `accept(...)` keeps what the target
verified. MoA keeps the cache entries of accepted draft nodes (its SA sees tokens only); EAGLE recomputes them
from the target's true features. Offline, `next_token()` drafts one token at a time with the memory frozen; an
`OfflineGuard` keeps those unverified tokens out of degenerate loops (it never touches the drafted trees, so
verified output stays the target's).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Iterable, Protocol

import numpy as np

from moa_core.lookup import MAX_NGRAM, MIN_NGRAM, find_continuation
from moa_core.tree import ROOT, DraftTree, TreeConfig, build_tree, graft, topk_logprobs

NEG_INF = np.float32(-np.inf)


class DraftStep(Protocol):
    """One drafter call (torch or ONNX Runtime), numpy in and out, batch size 1.

    ids/positions int64 (n,); past_k/past_v (h_kv, T, d); mask float32 (n, T+n) additive; memory (M, R) for MoA;
    features (n, H) for EAGLE. Returns logits (n, V), features (n, H), keys (h_kv, T+n, d), values.
    """

    arch: str
    keeps_draft_cache: bool
    cache_shape: tuple[int, int]
    draft_vocab: np.ndarray | None  # int64 target-vocabulary id of each logit column (reduced vocab), or None
    vocab_size: int  # the target's vocabulary

    def __call__(self, ids, positions, past_k, past_v, mask, memory, features) -> tuple[
        np.ndarray, np.ndarray, np.ndarray, np.ndarray]: ...


@dataclass(frozen=True)
class OfflineGuard:
    """Decoding rules for unverified (offline) tokens: no degenerate loops (over the last `window` tokens), and
    copying what the text repeats.

    `no_repeat_ngram` n > 0: a token that would complete an n-gram already in the unverified stretch (the window's
    share of it) is banned; repeats of verified text (a list's pattern, a name) stay allowed.
    `max_newlines` m > 0: no run of more than m newlines (whitespace between them allowed); it needs the
    vocabulary's token texts, given with `for_vocabulary`.
    `repetition_penalty` r > 1: tokens already in the window have positive logits divided by r, negative ones
    multiplied (as in Hugging Face `generate`).
    `copy`: when the transcript's last n-gram (n = 3, else 2, ... down to `copy_min_ngram`) occurred before, the
    token that followed its latest occurrence (prompt lookup's proposal) is taken, unless another rule bans it or it is a special token (an
    end of turn copied from the prompt's template would end the reply): text an answer repeats (names, code, the
    question's words) is copied rather than guessed anew, tokens outside a reduced draft vocabulary included."""

    no_repeat_ngram: int = 4
    max_newlines: int = 2
    repetition_penalty: float = 1.0
    window: int = 64
    copy: bool = True
    copy_min_ngram: int = MIN_NGRAM
    # per token id: the newlines of a whitespace-only token, -1 for any other token (set by for_vocabulary)
    newlines: np.ndarray | None = field(default=None, repr=False, compare=False)
    # special tokens (end of turn, chat markers: set by for_vocabulary), never copied: the prompt's template has them
    special: frozenset[int] = field(default=frozenset(), repr=False, compare=False)

    def __post_init__(self):
        if (min(self.no_repeat_ngram, self.max_newlines) < 0 or self.repetition_penalty < 1 or self.window < 1
                or not MIN_NGRAM <= self.copy_min_ngram <= MAX_NGRAM):
            raise ValueError(f"bad offline guard {self}: no_repeat_ngram and max_newlines >= 0, "
                             f"repetition_penalty >= 1, window >= 1, copy_min_ngram in [{MIN_NGRAM}, {MAX_NGRAM}]")

    @property
    def settings(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("newlines", "special")}

    def for_vocabulary(self, texts: list[str], special: Iterable[int] = ()) -> "OfflineGuard":
        """The guard with the newline table of a vocabulary (`texts[i]`: token i decoded alone) and its special
        tokens' ids (end of turn included)."""
        return replace(self, newlines=np.array([t.count("\n") if not t.strip() else -1 for t in texts]),
                       special=frozenset(int(i) for i in special))

    def apply(self, logits: np.ndarray, history: list[int], unverified: int | None = None) -> np.ndarray:
        """The next token's logits (V,) after the rules, given the tokens so far, of which the last `unverified`
        were not verified (None: all of them)."""
        recent = np.asarray(history[-self.window:], dtype=np.int64)
        out = logits.astype(np.float32).copy()
        if self.repetition_penalty > 1 and len(recent):
            seen = np.unique(recent)
            r = self.repetition_penalty
            out[seen] = np.where(out[seen] > 0, out[seen] / r, out[seen] * r)
        banned = np.zeros(len(out), dtype=bool)
        n = self.no_repeat_ngram
        stretch = recent[-min(len(recent), len(history) if unverified is None else unverified):]
        if n and len(stretch) >= n:
            windows = np.lib.stride_tricks.sliding_window_view(stretch, n)
            banned[windows[(windows[:, :-1] == stretch[len(stretch) - n + 1:]).all(axis=1), -1]] = True
        if self.max_newlines and self.newlines is not None:
            run = 0
            for t in reversed(recent):
                if t >= len(self.newlines) or self.newlines[t] < 0:
                    break
                run += self.newlines[t]
            table = self.newlines[: len(out)]
            banned[: len(table)] |= (table > 0) & (run + table > self.max_newlines)
        if self.copy:
            found = find_continuation(history, MAX_NGRAM, self.copy_min_ngram, 1)
            if found and found[0] < len(out) and not banned[found[0]] and found[0] not in self.special:
                copied = np.full_like(out, NEG_INF)
                copied[found[0]] = 0.0  # probability 1, whatever the temperature
                return copied
        out[banned] = NEG_INF
        return out


@dataclass
class DraftStats:
    drafter_calls: int = 0
    drafted_tokens: int = 0


class DraftSession:
    def __init__(self, step: DraftStep, candidates: int = 16):
        self.step = step
        self.candidates = candidates  # K: top-K of the draft distribution kept per expanded node
        h, d = step.cache_shape
        self.k = np.zeros((h, 0, d), dtype=np.float32)
        self.v = np.zeros((h, 0, d), dtype=np.float32)
        self.memory: np.ndarray | None = None  # (M, R): one row per verified token
        self.tokens: list[int] = []  # verified tokens (the transcript the drafter has seen)
        self.stats = DraftStats()
        self._verified_slots = 0  # cache slots 0.._verified_slots-1 hold transcript tokens
        self._tree_slots: dict[int, int] = {}
        self._tree_features: dict[int, np.ndarray] = {}
        self._root_feature: np.ndarray | None = None
        self._offline_from: int | None = None  # transcript index of the first token next_token was given

    def add_verified(self, tokens: list[int], rows: np.ndarray) -> None:
        """Tokens the target has verified, with their memory rows (one per token)."""
        rows = np.asarray(rows, dtype=np.float32)
        if len(tokens) != len(rows):
            raise ValueError(f"{len(tokens)} tokens but {len(rows)} memory rows")
        self.tokens.extend(int(t) for t in tokens)
        self.memory = rows if self.memory is None else np.concatenate([self.memory, rows])

    def _features_for(self, positions: np.ndarray) -> np.ndarray | None:
        """EAGLE's input feature of the token at position i is the target's feature of i-1 (a memory row)."""
        if self.step.arch != "eagle":
            return None
        return self.memory[positions - 1]

    def _run(self, ids, positions, mask, features):
        logits, feats, k, v = self.step(np.asarray(ids, dtype=np.int64), np.asarray(positions, dtype=np.int64),
                                        self.k, self.v, mask.astype(np.float32), self.memory, features)
        self.k, self.v = k, v
        self.stats.drafter_calls += 1
        return logits, feats

    def _prime(self, root: int) -> tuple[np.ndarray, np.ndarray]:
        """Run the verified tokens without a cache entry, then the root; return the root's logits and feature."""
        start = self._verified_slots
        ids = self.tokens[start:] + [root]
        n = len(ids)
        positions = np.arange(start, start + n)
        mask = np.zeros((n, start + n), dtype=np.float32)
        mask[:, start:] = np.triu(np.full((n, n), NEG_INF, dtype=np.float32), 1)
        logits, feats = self._run(ids, positions, mask, self._features_for(positions))
        return logits[-1:], feats[-1:]

    def draft(self, root: int, cfg: TreeConfig, temperature: float = 0.0,
              rng: np.random.Generator | None = None, copy: list[int] | None = None) -> DraftTree:
        """Draft a tree below `root` (the target's next token, at position len(tokens)), with the `copy` chain
        (prompt lookup's proposal, `moa_core.lookup.copy_chain`) grafted onto it."""
        base = len(self.tokens)  # the root's position
        self._tree_slots, self._tree_features = {}, {}

        def expand(nodes, tokens, parents, depths):
            if nodes == [ROOT]:
                logits, feats = self._prime(root)
                self._root_feature = feats[0]
            else:
                logits, feats = self._expand_nodes(nodes, tokens, parents, depths, base)
            for node, f in zip(nodes, feats):
                self._tree_features[node] = f
            self.stats.drafted_tokens += len(nodes)
            ids, logq = topk_logprobs(logits, self.candidates, temperature)
            return self._vocab_ids(ids), logq

        tree = build_tree(expand, cfg, sample=temperature > 0, rng=rng)
        if copy:
            tree = graft(tree, copy)
        return tree

    def _vocab_ids(self, index: np.ndarray) -> np.ndarray:
        """Logit columns -> target-vocabulary ids (they differ under a reduced draft vocabulary)."""
        return index if self.step.draft_vocab is None else self.step.draft_vocab[index]

    def _expand_nodes(self, nodes, tokens, parents, depths, base):
        start = self.k.shape[1]
        n = len(nodes)
        mask = np.full((n, start + n), NEG_INF, dtype=np.float32)
        mask[:, : base + 1] = 0.0  # verified tokens and the root
        for row, node in enumerate(nodes):
            a = parents[node]
            while a != ROOT:
                mask[row, self._tree_slots[a]] = 0.0
                a = parents[a]
            mask[row, start + row] = 0.0
            self._tree_slots[node] = start + row
        features = None
        if self.step.arch == "eagle":
            features = np.stack([self._tree_features[parents[i]] if parents[i] != ROOT else self._root_feature
                                 for i in nodes])
        positions = np.array([base + depths[i] for i in nodes])
        return self._run([tokens[i] for i in nodes], positions, mask, features)

    def accept(self, tree: DraftTree, root: int, path: list[int], rows: np.ndarray) -> None:
        """The target verified root + tree nodes `path`: keep their cache entries (MoA) and add memory rows."""
        base = len(self.tokens)
        keep = list(range(base + 1))  # verified slots and the root's
        if self.step.keeps_draft_cache:
            for node in path:
                slot = self._tree_slots.get(int(tree.origin[node]))
                if slot is None:  # a copied node: it and what follows are run with the next root
                    break
                keep.append(slot)
        self._keep(keep)
        self.add_verified([root] + [int(tree.tokens[i]) for i in path], rows)

    def _keep(self, slots: list[int]) -> None:
        self.k = self.k[:, slots]
        self.v = self.v[:, slots]
        self._verified_slots = len(slots)

    def next_token(self, root: int, temperature: float = 0.0, rng: np.random.Generator | None = None,
                   guard: OfflineGuard | None = None) -> int:
        """Offline: the drafter's own next token after `root`, which joins the transcript unverified.

        MoA's memory stays frozen; EAGLE's own predicted feature stands in for the target's (its next input).
        `guard` applies its rules before the token is chosen: over the transcript (root included), the n-gram rule
        over the tokens from the first root given to this method on (the unverified stretch).
        """
        if self._offline_from is None:
            self._offline_from = len(self.tokens)
        logits, feats = self._prime(root)
        self._verified_slots = self.k.shape[1]
        self.tokens.append(root)
        if self.step.arch == "eagle":
            self.memory = np.concatenate([self.memory, feats])
        logits = self._target_vocab_logits(logits[-1:])
        if guard is not None:
            logits = guard.apply(logits[-1], self.tokens, len(self.tokens) - self._offline_from)[None]
        if temperature <= 0:
            return int(np.argmax(logits[-1]))
        ids, logq = topk_logprobs(logits, self.candidates, temperature)
        p = np.exp(logq[0] - logq[0].max())
        return int(rng.choice(ids[0], p=p / p.sum()))

    def _target_vocab_logits(self, logits: np.ndarray) -> np.ndarray:
        """(n, columns) drafter logits -> (n, V) over the target's vocabulary (-inf outside a reduced one)."""
        if self.step.draft_vocab is None:
            return logits
        full = np.full((len(logits), self.step.vocab_size), NEG_INF, dtype=np.float32)
        full[:, self.step.draft_vocab] = logits
        return full
