"""Prompt-lookup decoding: the n-gram search, the chain it drafts, lossless greedy and sampling; the generate CLI."""

import json
from collections import Counter

import torch

from moa_core.lookup import find_continuation
from moa_core.tree import TreeConfig
from models.engine import SpeculativeEngine
from models.lookup import PromptLookup, chain_tree
from models.verify import Sampling, target_probs, verify_tree
from tests.helpers import greedy_continuations
from tests.helpers import chi_square_p, joint_first_two


def test_longest_then_most_recent_match():
    assert find_continuation([1, 2, 3, 7, 5, 2, 3, 8, 1, 2, 3], 3, 1, 4) == [7, 5, 2, 3]  # 3-gram beats a later 2-gram
    assert find_continuation([5, 1, 2, 7, 1, 2, 9, 1, 2], 2, 1, 2) == [9, 1]  # the most recent occurrence
    assert find_continuation([4, 4, 4], 3, 1, 5) == [4]  # overlapping matches, stops at the transcript's end
    assert find_continuation([1, 2, 3], 3, 1, 5) == []
    assert find_continuation([7], 3, 1, 5) == []


def test_chain_tree_is_one_hot():
    tree = chain_tree([5, 6, 7])
    assert tree.parents.tolist() == [-1, 0, 1] and tree.depths.tolist() == [1, 2, 3]
    assert tree.q_ids[:, 0].tolist() == [5, 6, 7, 0] and tree.q_probs[:, 0].tolist() == [1, 1, 1, 0]
    assert len(chain_tree([])) == 0


def test_lookup_greedy_equals_vanilla(tiny):
    vanilla = SpeculativeEngine(tiny, None)
    lookup = SpeculativeEngine(tiny, "lookup", tree="5,1,5")
    assert lookup.proposer is not None and str(lookup.tree) == "5,1,5"
    forwards = [0, 0]
    for sample in greedy_continuations(tiny, 4, seed=3):
        prompt = sample.ids[:6]
        a = vanilla.generate(prompt, max_new_tokens=48)
        b = lookup.generate(prompt, max_new_tokens=48)
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert b.stats.drafter_calls == 0
        forwards[0] += a.stats.target_forwards
        forwards[1] += b.stats.target_forwards
    assert forwards[1] < forwards[0], forwards  # repeats in the text really get accepted


def test_lookup_sampling_keeps_the_target_distribution():
    from models.tiny import tiny_target

    tiny = tiny_target(vocab_size=12, seed=3)
    sampling, n = Sampling(1.0), 1000
    prompt, root = [3, 5, 7, 4, 9, 6, 3, 5], 7
    tree = PromptLookup().propose(prompt + [root], TreeConfig(2, 1, 2))
    assert tree.tokens.tolist() == [4, 9]
    g = torch.Generator().manual_seed(0)
    counts = Counter()
    runner = tiny.new_runner()
    runner.forward(prompt)
    for _ in range(n):
        v = verify_tree(runner, root, tree, sampling, g)
        seq = v.accepted + [v.next_token]
        if len(seq) < 2:
            seq.append(int(torch.multinomial(target_probs(runner.forward(seq).logits[-1], sampling), 1, generator=g)))
        counts[tuple(seq[:2])] += 1
        runner.crop(len(prompt))
    assert chi_square_p(counts, joint_first_two(tiny, prompt, root, sampling), n) > 1e-3
    assert counts[(4, 9)] > 0  # the drafted chain does get accepted


def test_generate_cli(tmp_path, capsys):
    from models.generate import main

    chat = tmp_path / "chat.json"
    chat.write_text(json.dumps({"messages": [{"role": "user", "content": "abc abc abc"}]}))
    main(["--chat", str(chat), "--drafter", "lookup", "--target", "tiny", "--dtype", "float64", "--max-new-tokens",
          "20", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert {"text", "token_ids", "stats", "finish_reason"} <= set(out) and len(out["token_ids"]) <= 20
    assert {"tau", "tokens_per_s", "target_forwards", "drafter_calls", "draft_s", "verify_s"} <= set(out["stats"])
    main(["hello", "--drafter", "none", "--target", "tiny", "--dtype", "float64", "--max-new-tokens", "8"])
    captured = capsys.readouterr()
    assert "tokens/s" in captured.err and captured.out.endswith("\n")


def test_copy_statistics_by_match_length():
    from models.data import Encoded
    from models.lookup import copy_statistics

    sample = Encoded("a", [5, 1, 2, 3, 9, 1, 2, 3, 7], [0, 0, 0, 0, 0, 1, 1, 1, 1])
    stats = copy_statistics([sample], copy_tokens=4)
    # root 1 (a 1-gram match) proposes 2 3 9 1: 2 right; root 2 ([1 2]) proposes 3 9 1 2: 1; root 3 ([1 2 3]): 0
    assert stats["positions"] == 3
    assert {n: f["mean_accepted"] for n, f in stats["by_match"].items()} == {1: 2.0, 2: 1.0, 3: 0.0}
    assert stats["by_match"][2]["at_least_one"] == 1.0 and stats["by_match"][3]["at_least_one"] == 0.0
    assert copy_statistics([sample], copy_tokens=4, first=1)["positions"] == 1
