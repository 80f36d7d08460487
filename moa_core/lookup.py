"""Prompt lookup's search, in numpy: shared by the `PromptLookup` drafter (models.lookup) and the edge's offline
decoding rules (`OfflineGuard.copy`)."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

MAX_NGRAM, MIN_NGRAM = 3, 1  # the default search: the transcript's last 3 tokens, else 2, else 1


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
