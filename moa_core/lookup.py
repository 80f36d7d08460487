"""Prompt lookup's search, in numpy: shared by the `PromptLookup` drafter (models.lookup), the copy chains that
greedy speculation adds to a drafter's tree (`copy_chain`) and the edge's offline decoding rules
(`OfflineGuard.copy`)."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

MAX_NGRAM, MIN_NGRAM = 3, 1  # the default search: the transcript's last 3 tokens, else 2, else 1
# A copy chain needs the last 2 tokens to recur: on the target's held-out answers a 1-token match is followed by
# 0.64 right tokens, a 2-token one by 2.02, a 3-token one by 5.76 (`python -m models.lookup --first 128`).
COPY_MIN_NGRAM = 2
COPY_TOKENS = 16  # the longest copy chain the CLIs and benchmarks verify (`--copy-tokens`)


def find_continuation(transcript: list[int], max_ngram: int, min_ngram: int, num_draft: int) -> list[int]:
    """Tokens that followed the most recent earlier occurrence of the longest matching suffix n-gram."""
    seq = np.asarray(transcript, dtype=np.int64)
    for n in range(min(max_ngram, len(seq) - 1), min_ngram - 1, -1):
        # windows start at 0..len-1-n: each has a following token and none is the suffix itself
        windows = sliding_window_view(seq[:-1], n)
        hits = np.flatnonzero((windows == seq[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return seq[start : start + num_draft].tolist()
    return []


def copy_chain(transcript: list[int], max_tokens: int) -> list[int]:
    """Up to `max_tokens` tokens that followed the latest earlier occurrence of the transcript's last 3 (else 2)
    tokens, its last token being the root of the next draft tree; [] without such a match (or max_tokens 0)."""
    return find_continuation(transcript, MAX_NGRAM, COPY_MIN_NGRAM, max_tokens) if max_tokens > 0 else []
