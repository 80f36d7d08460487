"""The edge's I/O-free core (edge_client/core.py) against the server's sessions in-process, frames in and out, no
server process and no socket: lossless rounds, state changes, replies checked before anything changes, resync under
both policies (keep takes the offline tokens, verify rewinds to the first disagreement) and a lost session re-fed."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from edge_client.core import EdgeCore, EdgeError, State, Stats, common_prefix
from moa_core import protocol as P
from moa_core.tree import TreeConfig
from models.registry import build_drafter
from models.engine import SpeculativeEngine, TorchDraftStep
from server.config import Limits
from server.session import Model, Session, sampling_of
from tests.helpers import CoreClient, greedy_continuations

TREE = TreeConfig(3, 2, 6)
NEW = 24


class Sessions:
    """The verify server's sessions without the server: one request frame in, its reply frame out."""

    def __init__(self, model: Model):
        self.model, self.sessions, self.opened = model, {}, 0

    def open(self) -> str:
        self.opened += 1
        sid = f"session-{self.opened}"
        self.sessions[sid] = Session(sid, "test", "fp16", self.model)
        return sid

    def drop(self, sid: str) -> None:
        del self.sessions[sid]

    def exchange(self, frame: bytes) -> bytes:
        msg = P.decode(frame)
        P.validate(msg)
        f = msg.fields
        try:
            if f["session_id"] not in self.sessions:
                raise P.ProtocolError(f"no session {f['session_id']}", P.E_UNKNOWN_SESSION)
            s, sampling, tokens = self.sessions[f["session_id"]], sampling_of(f), msg.tensors["tokens"].tolist()
            if msg.type == P.PREFILL:
                return s.prefill(f["seq"], tokens, sampling)
            if msg.type == P.RESUME:
                return s.resume(f["length"], tokens, f["policy"], sampling)
            root, tree = P.decode_tree(msg.tensors, self.model.vocab_size, 64, need_q=not sampling.greedy)
            return s.verify(f["seq"], root, tree, sampling)
        except P.ProtocolError as e:
            return P.error_frame(e.code, str(e))


@pytest.fixture(scope="module")
def model(tiny):
    torch.manual_seed(0)
    return Model(tiny, build_drafter("moa", tiny), Limits(max_context=256, max_tree_tokens=32), tree=str(TREE))


@pytest.fixture(scope="module")
def prompt(tiny) -> list[int]:
    return greedy_continuations(tiny, 1, seed=3)[0].ids[:6]


def vanilla(tiny, tokens: list[int], n: int = NEW) -> list[int]:
    return SpeculativeEngine(tiny, None).generate(list(tokens), max_new_tokens=n).token_ids


def edge(model: Model, server: Sessions, policy: str = "keep", copy_tokens: int = 0,
         temperature: float = 0.0) -> CoreClient:
    return CoreClient(server, server.open(), TorchDraftStep(model.drafter), model.drafter.row_width, TREE,
                      temperature=temperature, policy=policy, copy_tokens=copy_tokens)


def snapshot(core: EdgeCore) -> tuple:
    return (list(core.tokens), core.length, core.rows.copy(), core.pending, core.seq, core.state, core.session_id)


def same(a: tuple, b: tuple) -> bool:
    return all(np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y for x, y in zip(a, b))


def test_rounds_are_lossless_and_the_state_is_explicit(model, tiny, prompt):
    sc = edge(model, Sessions(model))
    core = sc.core
    assert core.state is State.OFFLINE  # nothing synced yet
    core.start(prompt, sc.sampling, sc.stats)
    core.begin_sync(sc.link_session)
    assert core.state is State.RESYNCING
    request = core.sync_request()
    assert request.type == P.PREFILL and request.tokens == tuple(prompt)  # a new prompt: prefill it
    core.on_reply(sc.call(request))
    assert core.state is State.ONLINE and core.length == len(prompt) and core.tokens[-1] == core.pending
    assert sc.continue_until(len(prompt), NEW, tiny.eos_token_ids) == vanilla(tiny, prompt)
    assert core.rows.shape == (core.length, model.drafter.row_width) and sc.stats.verify_calls > 0


@pytest.mark.parametrize("temperature", [0.0, 0.3])
def test_copy_chains_are_verified_and_lossless(model, tiny, temperature):
    """The untrained drafter gets next to nothing accepted; copy chains of what the tiny target repeats do, greedy
    (lossless) and sampling (the chain travels as `sources`; its distribution: tests/test_engine.py)."""
    taus = []
    for copy_tokens in (0, 8):
        sc = edge(model, Sessions(model), copy_tokens=copy_tokens, temperature=temperature)
        for sample in greedy_continuations(tiny, 3, seed=0):
            prompt = sample.ids[:6]
            sc.core.start(prompt, sc.sampling, sc.stats)
            sc.core.begin_sync(sc.link_session)
            sc.core.on_reply(sc.call(sc.core.sync_request()))
            out = sc.continue_until(len(prompt), 40, tiny.eos_token_ids)
            assert out == vanilla(tiny, prompt, 40) if temperature == 0 else len(out) > 0
        taus.append(sc.stats.tau)
        assert (sc.stats.copy_rounds > 0) == (copy_tokens > 0)
    assert taus[1] > taus[0] + 0.3, taus


def test_a_reply_is_checked_before_anything_changes(model, tiny, prompt):
    sc = edge(model, Sessions(model))
    sc.prefill(prompt)
    sc.round()
    request = sc.core.verify_request(sc.rng)
    good = P.decode(sc.client.exchange(request.frame))
    f, rows = good.fields, good.tensors["rows"]
    bad = [replace(good, type=P.RESUMED),
           replace(good, fields={**f, "seq": f["seq"] - 1}),
           replace(good, fields={**f, "length": f["length"] + 1}),
           replace(good, tensors={**good.tensors, "rows": rows[:-1]}),
           replace(good, fields={**f, "accepted": [1] + f["accepted"][1:]}),  # not from the root
           replace(good, fields={**f, "accepted": f["accepted"] + [len(request.tree) + 1]})]  # not a tree node
    before = snapshot(sc.core)
    for msg in bad:
        with pytest.raises(EdgeError):
            sc.core.on_reply(msg)
        assert same(snapshot(sc.core), before)
    assert len(sc.core.on_reply(good)) == len(f["accepted"])  # the genuine reply still applies
    assert sc.continue_until(len(prompt), NEW, tiny.eos_token_ids) == vanilla(tiny, prompt)


def go_offline(sc: CoreClient, n: int) -> list[int]:
    """The link drops: n tokens from the drafter alone; the pending root and those tokens."""
    sc.core.go_offline()
    for _ in range(n):
        sc.core.offline_token(0.0, None, None)
    assert sc.core.state is State.OFFLINE
    return sc.core.tokens[sc.core.length:]


def test_resume_keep_takes_the_offline_tokens(model, tiny, prompt):
    sc = edge(model, Sessions(model), policy="keep")
    sc.prefill(prompt)
    sc.round()
    tail = go_offline(sc, 5)
    committed = sc.committed
    assert sc.core.unverified(len(sc.core.generated)) == 5  # the root is the target's own
    reply = sc.resume("keep")
    assert reply.type == P.RESUMED and reply.fields["accepted_upto"] == len(tail)
    assert sc.core.state is State.ONLINE and sc.committed == committed + tail and sc.core.kept_unchecked == 5
    assert sc.core.unverified(len(sc.core.generated)) == 5  # kept, never checked
    transcript = sc.committed
    assert sc.continue_until(len(transcript), 12, tiny.eos_token_ids) == vanilla(tiny, transcript, 12)


def test_resume_verify_rewinds_to_the_first_disagreement(model, tiny, prompt):
    sc = edge(model, Sessions(model), policy="verify")
    sc.prefill(prompt)
    sc.round()
    at = sc.core.length - len(prompt)
    tail = go_offline(sc, 6)
    target = vanilla(tiny, prompt)
    kept = common_prefix(tail, target[at:at + len(tail)])
    reply = sc.resume("verify")
    assert reply.fields["accepted_upto"] == kept >= 1 and sc.stats.rewound_tokens == len(tail) - kept
    assert sc.core.kept_unchecked == 0 and sc.core.unverified(len(sc.core.generated)) == 0
    assert sc.continue_until(len(prompt), NEW, tiny.eos_token_ids) == target


def test_a_lost_session_gets_the_transcript_again(model, tiny, prompt):
    server = Sessions(model)
    sc = edge(model, server, policy="verify")
    sc.prefill(prompt)
    sc.round()
    old, committed = sc.core.session_id, sc.committed
    tail = go_offline(sc, 4)
    server.drop(old)  # the server restarted
    sc.link_session = server.open()
    sc.core.begin_sync(sc.link_session, lost=True)
    prefill = sc.core.sync_request()
    assert prefill.type == P.PREFILL and prefill.tokens == tuple(committed) and prefill.session_id == sc.link_session
    sc.core.on_reply(sc.call(prefill))
    # greedy: the target's next token is the old pending root, so the edge's continuation stands
    assert sc.core.state is State.RESYNCING and sc.core.pending == tail[0] and sc.core.tokens[sc.core.length:] == tail
    while sc.core.state is State.RESYNCING:  # the offline tail is resumed (checked) in the new session
        request = sc.core.sync_request()
        assert request.type == P.RESUME
        sc.core.on_reply(sc.call(request))
    assert sc.core.session_id == sc.link_session != old
    assert sc.continue_until(len(prompt), NEW, tiny.eos_token_ids) == vanilla(tiny, prompt)


def test_offline_from_the_start_needs_no_server(model, prompt):
    core = EdgeCore(TorchDraftStep(model.drafter), model.drafter.row_width, TREE)
    stats = Stats("offline")
    core.start(prompt, {"temperature": 0.0, "top_p": 1.0, "top_k": 0}, stats)
    core.go_offline()
    out = [core.offline_token(0.0, None, None) for _ in range(5)]
    assert core.generated == out and stats.offline_tokens == 5 and core.unverified(5) == 5 and core.length == 0
