"""Prompt-lookup decoding: a training-free drafter (Saxena 2023; `prompt_lookup_num_tokens` in Hugging Face).

The last n tokens of the transcript (prompt + generated + the root), n from `max_ngram` down to `min_ngram`, are
searched for earlier in the transcript; the most recent match proposes the tokens that followed it as a chain.
The draft distribution q is one-hot on each proposed token, so the rejection rule of `models.verify` accepts a
token with probability p(x) and stays lossless; greedy decoding accepts it when it is the target's argmax.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moa_core.lookup import COPY_TOKENS, MAX_NGRAM, MIN_NGRAM, find_continuation
from moa_core.tree import DraftTree, TreeConfig
from models.data import Encoded


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


def copy_statistics(samples: list[Encoded], copy_tokens: int = COPY_TOKENS, first: int | None = None) -> dict:
    """How right prompt lookup's proposal is on answers, by the length of the n-gram it matched (0 = none): at every
    answer token (its first `first` of each answer), taken as the root of a round, the share of such positions, the
    mean number of proposed tokens the answer goes on with (up to `copy_tokens`) and how often that is at least 1.
    On the target's own answers this is what a greedy copy chain gets accepted."""
    accepted: dict[int, list[int]] = {n: [] for n in range(MIN_NGRAM - 1, MAX_NGRAM + 1)}
    for s in samples:
        answer = [i for i, m in enumerate(s.response_mask) if m and i + 1 < len(s.ids)][:first]
        for i in answer:
            n, proposal = next(((n, p) for n in range(MAX_NGRAM, MIN_NGRAM - 1, -1)
                                if (p := find_continuation(s.ids[: i + 1], n, n, copy_tokens))), (0, []))
            right = s.ids[i + 1 : i + 1 + len(proposal)]
            accepted[n].append(next((k for k, (a, b) in enumerate(zip(proposal, right)) if a != b), len(right)))
    total = sum(len(v) for v in accepted.values())
    figures = {n: {"share": len(v) / total, "mean_accepted": float(np.mean(v)),
                   "at_least_one": float(np.mean(np.array(v) > 0))} for n, v in accepted.items() if v}
    return {"positions": total, "copy_tokens": copy_tokens, "first": first, "by_match": figures}


def main(argv: list[str] | None = None) -> None:
    import argparse
    import json

    from models.data import DataStats, as_encoded, encode_samples, iter_source
    from models.registry import load_target

    p = argparse.ArgumentParser(prog="python -m models.lookup", description="How often prompt lookup's proposal is "
                                "right on a set of answers (the target's own: what copy chains get accepted), by "
                                "the length of the n-gram matched")
    p.add_argument("--data", default="datasets/smollm2-heldout.jsonl.gz", help="conversations (jsonl[.gz]); "
                   "default: %(default)s")
    p.add_argument("--target", default="default", help="whose tokenizer and chat template (default: %(default)s)")
    p.add_argument("--copy-tokens", type=int, default=COPY_TOKENS, help="longest proposal (default: %(default)s)")
    p.add_argument("--first", type=int, default=None, help="only the first N tokens of each answer")
    p.add_argument("--out", help="write the figures as JSON here")
    args = p.parse_args(argv)
    tokenizer = load_target(args.target).tokenizer
    samples = as_encoded(encode_samples(iter_source(args.data), tokenizer, 4096, DataStats()))
    stats = copy_statistics(samples, args.copy_tokens, args.first)
    print(f"{stats['positions']} answer positions of {len(samples)} answers, proposals of up to {args.copy_tokens}")
    print("| n-gram matched | share of positions | mean tokens right | at least one right |\n|---|---|---|---|")
    for n, f in stats["by_match"].items():
        print(f"| {n or 'none'} | {f['share']:.0%} | {f['mean_accepted']:.2f} | {f['at_least_one']:.0%} |")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(stats, indent=1))


if __name__ == "__main__":
    main()
