"""Prompt-lookup decoding: a training-free drafter (Saxena 2023; `prompt_lookup_num_tokens` in Hugging Face).

The last n tokens of the transcript (prompt + generated + the root), n from `max_ngram` down to `min_ngram`, are
searched for earlier in the transcript; the most recent match proposes the tokens that followed it as a chain.
The draft distribution q is one-hot on each proposed token, so the rejection rule of `models.verify` accepts a
token with probability p(x) and stays lossless; greedy decoding accepts it when it is the target's argmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moa_core.lookup import MAX_NGRAM, MIN_NGRAM, find_continuation
from moa_core.tree import DraftTree, TreeConfig


def chain_tree(tokens: list[int]) -> DraftTree:
    """A chain below the root with a one-hot draft distribution at every node."""
    k = len(tokens)
    q_ids = np.zeros((k + 1, 1), dtype=np.int64)
    q_probs = np.zeros((k + 1, 1), dtype=np.float32)
    q_ids[:k, 0] = tokens  # row 0 (the root) proposes tokens[0], row i proposes tokens[i]; the last row none
    q_probs[:k, 0] = 1.0
    return DraftTree(
        tokens=np.asarray(tokens, dtype=np.int64).reshape(k),
        parents=np.arange(-1, k - 1, dtype=np.int64),
        depths=np.arange(1, k + 1, dtype=np.int64),
        q_ids=q_ids,
        q_probs=q_probs,
    )


@dataclass(frozen=True)
class PromptLookup:
    """The engine's `Proposer` for prompt lookup; the tree budget's depth is the number of drafted tokens."""

    max_ngram: int = MAX_NGRAM
    min_ngram: int = MIN_NGRAM
    default_tree: TreeConfig = TreeConfig(6, 1, 6)

    def propose(self, transcript: list[int], cfg: TreeConfig) -> DraftTree:
        return chain_tree(find_continuation(transcript, self.max_ngram, self.min_ngram, cfg.depth))
