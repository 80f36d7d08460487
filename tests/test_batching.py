"""Batched verification and streaming: the packed forward equals solo forwards, the scheduler keeps one sequence's
failure to itself, N clients at once (speculative edges, api streams, sampling) get exactly what each gets alone,
bad requests during a batch get their typed errors, and sampling through batches keeps the target distribution.
Float64 tiny targets: batch shape changes fp32 results by ~1e-5, float64 ones by ~1e-15 (docs/design.md §5)."""

from __future__ import annotations

import threading
import urllib.request
from collections import Counter

import numpy as np
import pytest
import torch

from moa_core import protocol as P
from moa_core.tree import TreeConfig
from models.batching import Batcher
from models.engine import SpeculativeEngine, TorchDraftStep
from models.target import forward_packed
from server.app import App
from server.config import Batching, Limits, parse_args
from server.session import Model
from server.testing import Client, ServerThread
from tests.helpers import (CoreClient, chi_square_p, first_two, greedy_continuations, joint_first_two,
                           tree_attention_mask)

TREE = TreeConfig(4, 2, 8)
NEW = 32
LIMITS = Limits(max_sessions=64, max_context=256, max_tree_tokens=32, max_message_bytes=1 << 16, idle_timeout_s=60)
GREEDY = {"temperature": 0.0, "top_p": 1.0, "top_k": 0}
WAIT = Batching(max_wait_ms=20.0)  # a generous wait, so that concurrent clients surely meet in batches


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def drafter(tiny_moa):
    return tiny_moa


@pytest.fixture(scope="module")
def prompts(tiny):
    return [s.ids[:6 + i % 3] for i, s in enumerate(greedy_continuations(tiny, 6, seed=4))]


@pytest.fixture(scope="module")
def vanilla(tiny, prompts):
    engine = SpeculativeEngine(tiny, None)
    return {tuple(p): engine.generate(p, max_new_tokens=NEW).token_ids for p in prompts}


# ---- the packed forward and the scheduler ---------------------------------------------------------------------
def test_packed_forward_equals_solo_forwards(tiny):
    """Prefills, a decode step and a tree of different sequences in one forward: what each gets alone."""
    contexts = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16]]
    news = [([20, 21, 22], None, "all"), ([23], None, "last"), ([24, 25, 26, 27], [-1, 0, 0, 1], "none")]

    def prepared():
        runners = [tiny.new_runner() for _ in contexts]
        for r, c in zip(runners, contexts):
            r.forward(c)
        return runners

    def request(r, ids, parents, logits):
        if parents is None:
            return r.request(ids, logits=logits)
        depths = [0, 1, 1, 2]
        return r.request(ids, [r.length + d for d in depths], tree_attention_mask(parents, tiny.dtype), logits)

    solo_runners, packed_runners = prepared(), prepared()
    solo = [forward_packed(tiny, [(r, request(r, *n))])[0] for r, n in zip(solo_runners, news)]
    packed = forward_packed(tiny, [(r, request(r, *n)) for r, n in zip(packed_runners, news)])
    for a, b, ra, rb in zip(solo, packed, solo_runners, packed_runners):
        assert (a.logits is None) == (b.logits is None) and ra.length == rb.length
        for x, y in [(a.hidden, b.hidden), (a.keys, b.keys), (a.values, b.values)] + \
                ([(a.logits, b.logits)] if a.logits is not None else []):
            torch.testing.assert_close(x, y, rtol=0, atol=1e-12)
        for la, lb in zip(ra.cache.layers, rb.cache.layers):
            torch.testing.assert_close(la.keys, lb.keys, rtol=0, atol=1e-12)


def test_int8_packed_forward_is_bitwise_the_solo_forward():
    """Int8 Linear layers scale each token on its own and accumulate exactly, attention runs per sequence: a batched
    forward of an int8 float32 target is bit for bit each sequence's solo forward (fp32 ones differ by ~1e-6)."""
    from models.tiny import tiny_target

    target = tiny_target(dtype=torch.float32, seed=2)
    target.quantize_int8()
    contexts, news = [[5, 6, 7], [9, 10, 11, 12, 13]], [[20, 21], [22]]
    solo, packed = [], [target.new_runner() for _ in contexts]
    for c, n in zip(contexts, news):
        r = target.new_runner()
        r.forward(c)
        solo.append(r.forward(n))
    for r, c in zip(packed, contexts):
        r.forward(c)
    steps = forward_packed(target, [(r, r.request(n)) for r, n in zip(packed, news)])
    for a, b in zip(solo, steps):
        assert torch.equal(a.logits, b.logits) and torch.equal(a.keys, b.keys) and torch.equal(a.hidden, b.hidden)


def test_a_failing_request_fails_alone_and_leaves_every_cache_as_it_was(tiny):
    """Three requests in one batch, one with a token id out of range (only validation keeps them out of a real
    server): the batch is undone and run request by request; the two good ones get their solo results."""
    batcher = Batcher(tiny, max_wait_s=30.0, wait_share=None)  # it waits for all three in flight
    try:
        runners = [tiny.new_runner(batcher) for _ in range(3)]
        solo = [tiny.new_runner() for _ in range(3)]
        results: dict[int, object] = {}
        ids = [[5, 6, 7], [8, 9, 10 ** 6], [11, 12]]

        def run(i: int) -> None:
            try:
                results[i] = runners[i].forward(ids[i])
            except Exception as e:  # noqa: BLE001 - reported below
                results[i] = e
            finally:
                batcher.end()

        for _ in range(3):
            batcher.begin()
        threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert batcher.stats.batch_size.count == 1 and batcher.stats.split_batches == 1
        assert isinstance(results[1], IndexError) and runners[1].length == 0
        assert all(layer.get_seq_length() == 0 for layer in runners[1].cache.layers if layer.is_initialized)
        for i in (0, 2):
            want = solo[i].forward(ids[i])
            torch.testing.assert_close(results[i].logits, want.logits, rtol=0, atol=1e-12)
            assert runners[i].length == len(ids[i])
        assert runners[1].forward([8, 9]).logits.shape[0] == 2  # the failed runner still serves
    finally:
        batcher.close()


def test_sampling_through_batches_keeps_the_target_distribution():
    """The chi-square test of tests/test_engine.py with four sequences sampling at once through one batcher."""
    from models.registry import build_drafter
    from models.tiny import tiny_target
    from models.verify import Sampling

    tiny = tiny_target(vocab_size=12, seed=3)
    torch.manual_seed(1)
    drafter = build_drafter("moa", tiny).eval()
    step = TorchDraftStep(drafter)
    prompt, root, n, workers = [3, 5, 7, 4, 9], 6, 2000, 4
    sampling = Sampling(1.0)
    rows = step.memory_rows(tiny.new_runner().forward(prompt), list(range(len(prompt))))
    batcher = Batcher(tiny, max_wait_s=0.05)
    counts: list[Counter] = [Counter() for _ in range(workers)]

    def run(w: int) -> None:
        g, rng = torch.Generator().manual_seed(w), np.random.default_rng(w)
        runner = tiny.new_runner(batcher)
        batcher.begin()
        try:
            runner.forward(prompt)
            for _ in range(n // workers):
                counts[w][first_two(runner, step, prompt, rows, root, sampling, g, rng)] += 1
        finally:
            batcher.end()

    try:
        threads = [threading.Thread(target=run, args=(w,)) for w in range(workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        stats = batcher.stats
    finally:
        batcher.close()
    assert stats.batch_size.sum > stats.batch_size.count  # forwards really were shared
    p = chi_square_p(sum(counts, Counter()), joint_first_two(tiny, prompt, root, sampling), n)
    assert p > 1e-3, p


# ---- the server -----------------------------------------------------------------------------------------------
def metrics(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    return {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if not line.startswith("#")}


def edge(client: Client, model: Model, drafter, **kw) -> CoreClient:
    return CoreClient(client, client.hello(model.fingerprint).fields["session_id"], TorchDraftStep(drafter),
                      drafter.row_width, TREE, **kw)


def run_clients(url: str, model: Model, drafter, prompts: list[list[int]], eos: set[int]) -> dict:
    """All at once: speculative greedy edges, api streams (generate, drafter none), a server-drafted generate and a
    sampling edge with a fixed seed; returns each one's tokens (or its exception)."""
    results: dict[tuple[str, int], object] = {}
    barrier = threading.Barrier(len(prompts) + 2)

    def run(kind: str, i: int) -> None:
        try:
            with Client(url) as c:
                if kind == "edge":
                    sc = edge(c, model, drafter)
                    barrier.wait(60)
                    results[kind, i] = sc.generate(prompts[i], NEW, eos)
                elif kind == "sample":
                    sc = edge(c, model, drafter, temperature=0.9, seed=3)
                    barrier.wait(60)
                    results[kind, i] = sc.generate(prompts[i], NEW, eos)
                else:
                    c.hello(model.fingerprint)
                    barrier.wait(60)
                    results[kind, i] = c.generate(prompts[i], NEW, "server" if kind == "server" else "none",
                                                  temperature=0.7 if kind == "server" else 0.0, seed=11)[1].fields["tokens"]
        except Exception as e:  # noqa: BLE001 - compared below
            results[kind, i] = e

    jobs = [("edge" if i % 2 == 0 else "api", i) for i in range(len(prompts))] + [("sample", 0), ("server", 1)]
    threads = [threading.Thread(target=run, args=job) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    return results


def test_clients_at_once_get_their_solo_outputs_token_for_token(tiny, drafter, prompts, vanilla):
    """Batching on: 6 greedy clients (3 speculative edges, 3 api streams), a sampling edge and a seeded sampled
    server-side generation at once; every output equals that client's run alone on a FIFO server (the sampling edge,
    whose sampler the server seeds, only runs along: tests the distribution below), and the greedy ones equal
    vanilla decoding. The batches really held several sessions."""
    fifo = Model(tiny, drafter, LIMITS, tree=str(TREE), batching=Batching(enabled=False))
    batched = Model(tiny, drafter, LIMITS, tree=str(TREE), batching=WAIT)
    with ServerThread(App(fifo)) as srv:
        alone = {}
        for i, p in enumerate(prompts):  # one client at a time
            with Client(srv.url) as c:
                if i % 2 == 0:
                    alone["edge", i] = edge(c, fifo, drafter).generate(p, NEW, tiny.eos_token_ids)
                else:
                    c.hello(fifo.fingerprint)
                    alone["api", i] = c.generate(p, NEW, "none")[1].fields["tokens"]
        with Client(srv.url) as c:
            alone["sample", 0] = edge(c, fifo, drafter, temperature=0.9, seed=3).generate(prompts[0], NEW,
                                                                                         tiny.eos_token_ids)
        with Client(srv.url) as c:
            c.hello(fifo.fingerprint)
            alone["server", 1] = c.generate(prompts[1], NEW, "server", temperature=0.7, seed=11)[1].fields["tokens"]
    assert all(alone[k] == vanilla[tuple(prompts[k[1]])] for k in alone if k[0] in ("edge", "api"))
    with ServerThread(App(batched)) as srv:
        together = run_clients(srv.url, batched, drafter, prompts, tiny.eos_token_ids)
        m = metrics(srv.port)
    sampled = together.pop(("sample", 0))  # the server seeds a session's sampler itself: not reproducible
    assert isinstance(sampled, list) and 0 < len(sampled) <= NEW
    assert together == {k: v for k, v in alone.items() if k != ("sample", 0)}
    assert m["moa_batching_enabled"] == 1 and m["moa_batch_size_sum"] > m["moa_batch_size_count"] > 0
    assert m['moa_batch_size_bucket{le="1"}'] < m["moa_batch_size_count"]
    assert m["moa_spec_decode_num_drafts_total"] > 0 and m['moa_spec_decode_num_accepted_tokens_per_pos_total{'
                                                            'position="0"}'] > 0
    assert m["moa_spec_decode_acceptance_length_count"] == m["moa_spec_decode_num_drafts_total"]


def test_bad_requests_during_batches_get_typed_errors_and_others_go_on(tiny, drafter, prompts, vanilla):
    """While clients generate at once, another sends out-of-range ids, a wrong root, a bad tree and garbage: each
    gets its typed error, the others' outputs are unchanged, and the bad client's session still serves."""
    model = Model(tiny, drafter, LIMITS, tree=str(TREE), batching=WAIT)
    V = tiny.spec.vocab_size
    with ServerThread(App(model)) as srv:
        errors: list[str] = []
        done = threading.Event()

        def bad() -> None:
            with Client(srv.url) as c:
                sc = edge(c, model, drafter)
                sc.prefill(prompts[0])
                while not done.is_set():
                    for frame, code in [
                        (P.encode(P.PREFILL, {"seq": sc.core.seq + 1}, {"tokens": np.array([5, V + 3], np.int32)}),
                         P.E_OUT_OF_VOCAB),
                        (P.encode(P.VERIFY, {"session_id": sc.core.session_id, "seq": sc.core.seq + 1, **GREEDY},
                                  {"tokens": np.array([sc.core.pending + 1 if sc.core.pending + 1 < V else 3, 4], np.int32),
                                   "parents": np.array([-1, 0], np.int32)}), P.E_BAD_TREE),
                        (P.encode(P.VERIFY, {"session_id": sc.core.session_id, "seq": sc.core.seq + 1, **GREEDY},
                                  {"tokens": np.array([sc.core.pending, 4], np.int32),
                                   "parents": np.array([-1, 5], np.int32)}), P.E_BAD_TREE),
                        (b"garbage", P.E_MALFORMED),
                        (P.encode(P.GENERATE, {"max_new_tokens": 4, "temperature": 0.0, "top_p": 1.0, "top_k": 0,
                                               "drafter": "none"}, {"tokens": np.array([-1], np.int32)}),
                         P.E_OUT_OF_VOCAB)]:
                        reply = P.decode(c.exchange(frame))
                        if reply.type != P.ERROR or reply.fields["code"] != code:
                            errors.append(f"{code}: {reply.type} {reply.fields}")
                errors.append(str(sc.continue_until(len(prompts[0]), NEW, tiny.eos_token_ids)
                                  == vanilla[tuple(prompts[0])]))

        noise = threading.Thread(target=bad)
        noise.start()
        together = run_clients(srv.url, model, drafter, prompts, tiny.eos_token_ids)
        done.set()
        noise.join(600)
    assert errors == ["True"], errors
    for (kind, i), out in together.items():
        if kind in ("edge", "api"):
            assert out == vanilla[tuple(prompts[i])], (kind, i, out)
        else:
            assert isinstance(out, list) and len(out) > 0, (kind, out)


def test_batching_flags():
    assert parse_args([]).batching == Batching()
    off = parse_args(["--batching", "off", "--batch-wait-ms", "0", "--batch-tokens", "64", "--max-batch", "4"])
    assert off.batching == Batching(False, 0.0, 64, 4)
    for bad in (["--batch-wait-ms", "-1"], ["--batch-tokens", "0"], ["--max-batch", "0"], ["--batching", "maybe"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
