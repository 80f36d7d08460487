"""Offline continuation: the guard's rules, the degeneration and agreement scores, a real drafter that loops
without the guard and does not with it, and `python -m bench offline` end to end on the tiny target.
(Through the edge client and a real server: test_client.py.)"""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from bench.__main__ import main
from bench.offline import Continuer, newline_run, repeated_ngrams, score
from moa_core.drafting import OfflineGuard
from models.registry import build_drafter
from tests.helpers import train_tiny


def test_guard_rules():
    logits = np.array([2.0, -1.0, 3.0, 0.5, 1.0], dtype=np.float32)
    history = [0, 1, 2, 0, 1]  # the 3-gram (0, 1, 2) is in the window: after (0, 1) token 2 is banned
    out = OfflineGuard(no_repeat_ngram=3, repetition_penalty=2.0, copy=False).apply(logits, history)
    assert out.tolist() == [1.0, -2.0, -np.inf, 0.5, 1.0]
    off = OfflineGuard(no_repeat_ngram=0, max_newlines=0, copy=False)
    assert off.apply(logits, history).tolist() == logits.tolist()
    out_of_window = OfflineGuard(no_repeat_ngram=3, window=3, copy=False)
    assert out_of_window.apply(logits, history).tolist() == logits.tolist()
    # the n-gram rule looks at the unverified stretch only: (0, 1, 2) was verified text, repeating it is fine
    assert not np.isinf(OfflineGuard(no_repeat_ngram=3, copy=False).apply(logits, history, unverified=3)).any()
    assert np.isinf(OfflineGuard(no_repeat_ngram=3, copy=False).apply(logits, history, unverified=5)).tolist()[2]
    with pytest.raises(ValueError, match="repetition_penalty"):
        OfflineGuard(repetition_penalty=0.5)


def test_guard_copies_what_the_text_repeats():
    """copy: after the last n-gram's earlier occurrence, the token that followed it is taken (probability 1), even
    outside a reduced draft vocabulary, unless another rule bans it; with nothing repeated the logits pass."""
    logits = np.array([2.0, -1.0, 3.0, 0.5, 1.0], dtype=np.float32)
    history = [4, 3, 1, 4, 3]  # (4, 3) occurred before, followed by 1, which the drafter ranks last
    off = OfflineGuard(no_repeat_ngram=0, max_newlines=0, copy=False)
    assert off.apply(logits, history).tolist() == logits.tolist()
    on = replace(off, copy=True)
    copied = on.apply(logits, history)
    assert copied.tolist() == [-np.inf, 0.0, -np.inf, -np.inf, -np.inf]
    outside = logits.copy()
    outside[1] = -np.inf  # outside a reduced draft vocabulary
    assert on.apply(outside, history).tolist() == copied.tolist()
    assert on.apply(logits, [0, 2, 3]).tolist() == logits.tolist()  # nothing repeats
    # a special token (say the template's end of turn) is never copied
    assert on.for_vocabulary(["a"] * 5, special=[1]).apply(logits, history).tolist() == logits.tolist()
    assert int(np.argmax(on.apply(logits, [3, 0, 2, 3]))) == 0  # the 1-gram (3) counts too
    assert replace(on, copy_min_ngram=2).apply(logits, [3, 0, 2, 3]).tolist() == logits.tolist()  # unless too short
    assert replace(on, copy_min_ngram=2).apply(logits, history).tolist() == copied.tolist()
    with pytest.raises(ValueError, match="copy_min_ngram"):
        OfflineGuard(copy_min_ngram=4)
    # the n-gram rule wins: copying 1 after (4, 3) would repeat the unverified (4, 3, 1)
    banned = OfflineGuard(no_repeat_ngram=3, max_newlines=0).apply(logits, history)
    assert np.isneginf(banned[1]) and int(np.argmax(banned)) == 2


def test_guard_caps_newline_runs():
    texts = ["a", "\n", "\n\n", " ", "b", "\n  "]
    guard = OfflineGuard(no_repeat_ngram=0, max_newlines=2, copy=False).for_vocabulary(texts)
    assert guard.newlines.tolist() == [-1, 1, 2, 0, -1, 1] and guard.settings["max_newlines"] == 2
    logits = np.zeros(6, dtype=np.float32)
    assert np.isinf(guard.apply(logits, [0])).tolist() == [False] * 6  # no run yet: a paragraph break is fine
    assert np.isinf(guard.apply(logits, [0, 1])).tolist() == [False, False, True, False, False, False]
    # "\n" + " " + "\n" is a run of two already: no token with a newline may follow; text or spaces may
    assert np.isinf(guard.apply(logits, [4, 1, 3, 5])).tolist() == [False, True, True, False, False, True]
    assert not np.isinf(guard.apply(logits, [1, 1, 4])).any()  # the run ended at "b"


def test_scores():
    assert repeated_ngrams([1, 2, 3, 4, 5, 6]) == 0.0
    assert repeated_ngrams([7] * 10) == 6 / 7  # every 4-gram but the first repeats
    assert newline_run("a\n\nb") == 2 and newline_run("a\n \n\t\n\nb\nc") == 4 and newline_run("abc") == 0
    s = score([5, 6, 9, 8], [5, 6, 7, 8, 1], "x\n\n\ny")
    assert s["exact_prefix"] == 2 and s["agreement"] == [True, True, False, True, False]
    assert s["degenerate"] and s["newline_run"] == 3 and s["produced"] == 4


def offline_tokens(tiny, drafter, guard: OfflineGuard | None, n: int = 40,
                   temperature: float = 0.0) -> tuple[list[int], list[int]]:
    """A real drafter continuing alone after a prompt, as the edge does offline: (transcript before, tokens)."""
    continuer = Continuer(tiny, drafter, guard, temperature)
    context = list(range(5, 15))
    with torch.no_grad():
        step = tiny.new_runner().forward(context)
    root = int(step.logits[-1].argmax())
    tokens = continuer.run(context, continuer.memory_rows(step, len(context)), root, n, np.random.default_rng(0))
    return context + [root], tokens


def test_guard_stops_a_real_loop(tiny):
    """An untrained MoA drafter loops offline (seeded: it does for every seed tried; an untrained EAGLE drafter
    loops for some seeds only); the guard's rules act on the logits, the same for both architectures."""
    torch.manual_seed(0)
    drafter = build_drafter("moa", tiny).eval()
    before, plain = offline_tokens(tiny, drafter, None)
    assert repeated_ngrams(plain) > 0.5  # the untrained drafter loops
    n = 3
    for temperature in (0.0, 1.0):  # greedy, and sampled (--offline-temperature)
        before, guarded = offline_tokens(tiny, drafter, OfflineGuard(no_repeat_ngram=n, window=64), 40, temperature)
        stretch = before[-1:] + guarded  # the root on: the unverified stretch
        grams = [tuple(stretch[i:i + n]) for i in range(len(stretch) - n + 1)]
        assert len(guarded) == 40 and len(set(grams)) == len(grams) and repeated_ngrams(guarded, n) == 0.0


def test_offline_bench_end_to_end(tiny, tmp_path):
    for arch in ("moa", "eagle"):
        train_tiny(tiny, arch, steps=60).save_pretrained(tmp_path / arch)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": i, "category": "c", "turns": [t]}) + "\n"
                               for i, t in enumerate(["hello there", "what is it", "more please"])))
    out = tmp_path / "out"
    main(["offline", "--prompts", str(prompts), "--cuts", "4,8", "--offline-tokens", "12", "--out", str(out),
          "--target", "tiny", "--dtype", "float64", "--moa", str(tmp_path / "moa"), "--eagle", str(tmp_path / "eagle"),
          "--no-repeat-ngram", "2", "--no-progress"])
    results = json.loads((out / "results.json").read_text())
    methods = results["methods"]
    assert list(methods) == ["target", "moa", "moa+guard", "eagle", "eagle+guard", "lookup"]
    assert results["settings"]["decoding"]["moa+guard"]["guard"] == {"no_repeat_ngram": 2, "max_newlines": 2,
                                                                     "repetition_penalty": 1.0, "window": 64,
                                                                     "copy": True, "copy_min_ngram": 1}
    records = [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines()]
    assert len(records) == 3 * 2 * 6
    for cut in ("4", "8"):
        assert all(methods[m][cut]["cases"] == 3 and len(methods[m][cut]["agreement"]) == 12 for m in methods)
        # the tiny target's own text loops, and drafters trained on it follow it; the guard forbids the loop
        assert methods["target"][cut]["degenerate"] == 1.0
        for arch in ("moa", "eagle"):
            assert methods[arch][cut]["agreement_mean"] > 0.5 and methods[arch][cut]["teacher_forced_mean"] > 0.5
            assert methods[f"{arch}+guard"][cut]["repeated_ngram"] == 0.0
    for r in records:  # exact_prefix is the agreement up to the first miss
        assert r["exact_prefix"] == (r["agreement"] + [False]).index(False)
    for pair in ("moa - eagle", "moa+guard - eagle+guard"):  # case by case, with a bootstrap interval
        for cut in ("4", "8"):
            c = results["comparisons"][pair][cut]
            mean = methods[pair.split(" - ")[0]][cut]["agreement_mean"] - methods[pair.split(" - ")[1]][cut][
                "agreement_mean"]
            assert c["cases"] == 3 and abs(c["mean"] - mean) < 1e-9 and c["ci95"][0] <= c["mean"] <= c["ci95"][1]
            assert c["first_better"] + c["second_better"] <= 3
    table = (out / "results.md").read_text()
    assert "| moa+guard | 8 |" in table and "| moa+guard - eagle+guard | 8 | 3 |" in table
    assert (out / "results.png").stat().st_size > 0
