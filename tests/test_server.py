"""Verify server over real loopback websockets: lossless greedy through prefill/verify and generate, every bad
input answered with its typed error (the session stays usable), auth, limits, concurrency, retries and resume."""

import json
import shutil
import ssl
import struct
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus

from moa_core import protocol as P
from moa_core.tree import TreeConfig
from models.engine import SpeculativeEngine, TorchDraftStep
from server.app import App
from server.auth import Credentials, bearer, load_tokens
from server.config import Limits, build_parser, parse_args
from server.process import ServerProcess
from server.session import Model
from server.testing import Client, ServerError, ServerThread
from tests.helpers import CoreClient, greedy_continuations

TREE = TreeConfig(4, 2, 8)
NEW = 40
LIMITS = Limits(max_sessions=64, max_context=256, max_tree_tokens=32, max_message_bytes=1 << 16, idle_timeout_s=60)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def drafter(tiny_moa):
    return tiny_moa


@pytest.fixture(scope="module")
def model(tiny, drafter):
    return Model(tiny, drafter, LIMITS, tree=str(TREE))


@pytest.fixture(scope="module")
def server(model):
    with ServerThread(App(model, Credentials(["alice", "bob"]))) as srv:
        yield srv


@pytest.fixture(scope="module")
def prompts(tiny):
    return [s.ids[:6] for s in greedy_continuations(tiny, 3, seed=0)]


@pytest.fixture(scope="module")
def vanilla(tiny, prompts):
    engine = SpeculativeEngine(tiny, None)
    return {tuple(p): engine.generate(p, max_new_tokens=NEW).token_ids for p in prompts}


def edge(client: Client, model: Model, drafter, **kw) -> CoreClient:
    welcome = client.hello(model.fingerprint, kw.pop("row_dtype", "fp16"))
    return CoreClient(client, welcome.fields["session_id"], TorchDraftStep(drafter), drafter.row_width, TREE, **kw)


def expect_error(client: Client, frame: bytes | str, code: str) -> P.Message:
    reply = P.decode(client.exchange(frame))
    assert reply.type == P.ERROR and reply.fields["code"] == code, reply.fields
    return reply


def expect_closed(client: Client, code: int) -> None:
    with pytest.raises(ConnectionClosed) as info:
        client.ws.recv(30)
    assert info.value.rcvd is not None and info.value.rcvd.code == code


def http_get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


# ---- tree codec ---------------------------------------------------------------------------------------------
def test_tree_codec_round_trip_and_checks():
    from moa_core.tree import DraftTree

    tree = DraftTree(np.array([4, 5, 6]), np.array([-1, 0, -1]), np.array([1, 2, 1]),
                     np.arange(8).reshape(4, 2), np.full((4, 2), 0.5, np.float32))
    wire = P.encode_tree(9, tree, with_q=True)
    assert wire["tokens"].tolist() == [9, 4, 5, 6] and wire["parents"].tolist() == [-1, 0, 1, 0]
    msg = P.decode(P.encode(P.VERIFY, {"session_id": "s", "seq": 1, "temperature": 1, "top_p": 1.0, "top_k": 0},
                            wire))
    P.validate(msg)
    root, back = P.decode_tree(msg.tensors, vocab_size=10, max_tokens=4, need_q=True)
    assert root == 9
    for name in ("tokens", "parents", "depths", "q_ids", "q_probs"):
        np.testing.assert_array_equal(getattr(back, name), getattr(tree, name))
    assert P.decode_tree(P.encode_tree(9, tree), 10, 4, need_q=False)[1].q_probs.sum() == 0
    for tensors, args, code in [(wire, (10, 3, True), P.E_LIMIT), (wire, (9, 4, True), P.E_OUT_OF_VOCAB),
                                (P.encode_tree(9, tree), (10, 4, True), P.E_BAD_TREE),
                                ({**wire, "parents": np.array([-1, 0, 3, 0], np.int32)}, (10, 4, False), P.E_BAD_TREE),
                                ({**wire, "tokens": wire["tokens"][:0], "parents": wire["parents"][:0]},
                                 (10, 4, False), P.E_BAD_TREE)]:
        with pytest.raises(P.ProtocolError) as info:
            P.decode_tree(tensors, *args)
        assert info.value.code == code


def test_tree_codec_carries_a_copy_chain():
    """A grafted copy chain travels as `sources` when sampling; a bad one is a typed bad_tree error."""
    from moa_core.tree import COPIED, DRAFTED, DraftTree, graft

    drafted = DraftTree(np.array([4, 5, 6]), np.array([-1, 0, -1]), np.array([1, 2, 1]),
                        np.arange(8).reshape(4, 2), np.full((4, 2), 0.5, np.float32), origin=np.arange(3))
    tree = graft(drafted, [4, 7, 8])  # follows node 0 (token 4), then two new nodes
    assert tree.sources.tolist() == [DRAFTED | COPIED, DRAFTED, DRAFTED, COPIED, COPIED]
    assert tree.copied_child(-1) == 0 and tree.copied_child(0) == 3 and tree.drawn_children(0) == [1]
    wire = P.encode_tree(9, tree, with_q=True)
    assert wire["sources"].tolist() == [0, 3, 1, 1, 2, 2] and "sources" not in P.encode_tree(9, tree)
    msg = P.decode(P.encode(P.VERIFY, {"session_id": "s", "seq": 1, "temperature": 1, "top_p": 1.0, "top_k": 0},
                            wire))
    P.validate(msg)
    np.testing.assert_array_equal(P.decode_tree(msg.tensors, 10, 8, need_q=True)[1].sources, tree.sources)
    for sources, says in [([0, 3, 1, 1, 2], r"must be \[6\]"), ([1, 3, 1, 1, 2, 2], "0 for the root"),
                          ([0, 3, 1, 1, 0, 2], "must be 1"), ([0, 3, 1, 1, 2, 6], "must be 1"),
                          ([0, 3, 1, 2, 1, 2], "one path")]:
        with pytest.raises(P.ProtocolError, match=says) as info:
            P.decode_tree({**wire, "sources": np.array(sources, np.uint8)}, 10, 8, need_q=True)
        assert info.value.code == P.E_BAD_TREE


# ---- lossless greedy ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("row_dtype", ["fp16", "int8"])
def test_prefill_verify_equals_vanilla(server, model, drafter, prompts, vanilla, tiny, row_dtype):
    with Client(server.url, "alice") as c:
        sc = edge(c, model, drafter, row_dtype=row_dtype)
        tokens = 0
        for p in prompts:
            assert sc.generate(p, NEW, tiny.eos_token_ids) == vanilla[tuple(p)]
            tokens += len(sc.committed) - len(p)
        assert sc.stats.verify_calls < 0.6 * tokens  # the drafter really gets paths accepted
        assert sc.core.rows.shape[1] == drafter.row_width


def test_generate_streams_vanilla_output(server, prompts, vanilla, tiny):
    with Client(server.url, "bob") as c:
        c.hello(server.app.model.fingerprint)
        for drafter in ("none", "server"):
            pieces, done = c.generate(prompts[0], NEW, drafter)
            assert done.type == P.DONE and done.fields["tokens"] == vanilla[tuple(prompts[0])]
            assert "".join(pieces) == done.fields["text"] and len(pieces) > 1
            assert done.fields["finish_reason"] in ("eos", "length") and done.fields["stats"]["new_tokens"] > 0
        a, b = (c.generate(prompts[1], 20, "server", temperature=0.9, seed=5)[1].fields["tokens"] for _ in range(2))
        assert a == b


def test_generate_verifies_copy_chains(server, tiny):
    """The server alone with copy chains (`copy_tokens`): the vanilla text in fewer target forwards."""
    prompt = greedy_continuations(tiny, 1, seed=0)[0].ids[:6]  # the tiny target's text repeats after it
    want = SpeculativeEngine(tiny, None).generate(prompt, max_new_tokens=40).token_ids
    with Client(server.url, "bob") as c:
        c.hello(server.app.model.fingerprint)
        plain, copied = (c.generate(prompt, 40, "none", copy_tokens=n)[1].fields for n in (0, 8))
        assert plain["tokens"] == copied["tokens"] == want
        assert plain["stats"]["copy_rounds"] == 0 < copied["stats"]["copy_rounds"]
        assert copied["stats"]["target_forwards"] < plain["stats"]["target_forwards"]
        with pytest.raises(ServerError, match="copy_tokens") as info:
            c.generate(prompt, 40, "none", copy_tokens=server.app.limits.max_tree_tokens)
        assert info.value.code == P.E_LIMIT


def test_generate_continues_a_session_cache(server, model, drafter, prompts, vanilla, tiny):
    """A plain `generate` naming a session whose transcript starts the prompt continues its target cache (an edge
    handing a reply over pays no prefill); the session's own transcript goes on untouched."""
    prompt = prompts[2]
    with Client(server.url, "alice") as c:
        sc = edge(c, model, drafter)
        sc.prefill(prompt)
        sc.round()
        transcript, length = list(sc.core.tokens), sc.core.length  # committed + the pending root
        want = SpeculativeEngine(tiny, None).generate(transcript, max_new_tokens=12).token_ids
        streamed: list[int] = []
        pieces, done = c.generate(transcript, 12, session_id=sc.core.session_id, streamed=streamed)
        assert done.fields["tokens"] == streamed == want and "".join(pieces) == done.fields["text"]
        assert done.fields["stats"]["cached_tokens"] == length
        other = transcript[:-2] + [(transcript[-2] + 1) % tiny.spec.vocab_size, transcript[-1]]  # not its transcript
        done = c.generate(other, 12, session_id=sc.core.session_id)[1]
        assert done.fields["stats"]["cached_tokens"] == 0
        assert done.fields["tokens"] == SpeculativeEngine(tiny, None).generate(other, max_new_tokens=12).token_ids
        assert c.generate(transcript, 4, session_id="gone")[1].fields["stats"]["cached_tokens"] == 0
        assert sc.continue_until(len(prompt), NEW, tiny.eos_token_ids) == vanilla[tuple(prompt)]
        with Client(server.url, "bob") as b:
            b.hello(model.fingerprint)
            with pytest.raises(ServerError) as info:
                b.generate(transcript, 4, session_id=sc.core.session_id)
            assert info.value.code == P.E_FOREIGN_SESSION


def test_sampling_verify(server, model, drafter, prompts, tiny):
    with Client(server.url, "alice") as c:
        sc = edge(c, model, drafter, temperature=0.9, seed=1)
        out = sc.generate(prompts[0], 30, tiny.eos_token_ids)
        assert 0 < len(out) <= 30 and all(0 <= t < tiny.spec.vocab_size for t in out)


def test_retry_gets_the_cached_reply(server, model, drafter, prompts, vanilla, tiny):
    with Client(server.url, "alice") as c:
        sc = edge(c, model, drafter)
        sc.prefill(prompts[1])
        frame = sc.core.verify_request(sc.rng).frame
        first = c.exchange(frame)
        assert c.exchange(frame) == first  # the reply was lost: the same seq gets the same bytes, state untouched
        sc.apply(P.decode(first))
        assert sc.continue_until(len(prompts[1]), NEW, tiny.eos_token_ids) == vanilla[tuple(prompts[1])]


# ---- bad input ----------------------------------------------------------------------------------------------
def raw_frame(header: dict, payload: bytes = b"") -> bytes:
    h = json.dumps(header).encode()
    return P.MAGIC + struct.pack("<I", len(h)) + h + payload


def test_bad_input_gets_typed_errors_and_the_session_goes_on(server, model, drafter, prompts, vanilla, tiny):
    prompt, V = prompts[2], tiny.spec.vocab_size
    c = Client(server.url, "alice")
    sc = edge(c, model, drafter)
    sid = sc.link_session
    sc.prefill(prompt)
    sc.round()
    sc.round()
    request = sc.core.verify_request(sc.rng)  # the good request, sent at the end
    frame, root, seq = request.frame, sc.core.pending, sc.core.seq
    fields = {"session_id": sid, "seq": seq, "temperature": 0, "top_p": 1.0, "top_k": 0}
    good = P.encode_tree(root, request.tree, with_q=True)

    def verify(tensors=None, **over):
        return P.encode(P.VERIFY, {**fields, **over}, {**good, **(tensors or {})})

    def with_(name, i, value):
        a = good[name].copy()
        a[i] = value
        return {name: a}

    chain = {"tokens": np.full(40, root, np.int32), "parents": np.arange(-1, 39, dtype=np.int32)}
    cases = [
        (b"garbage", P.E_MALFORMED),
        ("a text frame", P.E_MALFORMED),
        (raw_frame({"type": "bye", "v": 1, "fields": {}, "tensors": []}), P.E_UNKNOWN_TYPE),
        (P.encode(P.DONE, {"tokens": [], "text": "", "finish_reason": "eos", "stats": {}}), P.E_UNKNOWN_TYPE),
        (P.encode(P.VERIFY, {k: v for k, v in fields.items() if k != "seq"}, good), P.E_BAD_REQUEST),
        (verify({"tokens": good["tokens"].astype(np.int64)}), P.E_BAD_REQUEST),
        (verify(top_p=0.0), P.E_BAD_REQUEST),
        (raw_frame({"type": "verify", "v": 1, "fields": fields, "tensors": [
            {"name": "tokens", "dtype": "int32", "shape": [3], "offset": 0, "nbytes": 8}]}, bytes(8)),
         P.E_TENSOR_MISMATCH),
        (verify(with_("tokens", -1, V)), P.E_OUT_OF_VOCAB),
        (verify(with_("q_ids", (0, 0), V + 3), temperature=0.7), P.E_OUT_OF_VOCAB),
        (verify(with_("parents", 0, 0)), P.E_BAD_TREE),
        (verify(with_("parents", 2, 2)), P.E_BAD_TREE),
        (verify({"parents": good["parents"][:-1]}), P.E_BAD_TREE),
        (verify(with_("tokens", 0, (root + 1) % V)), P.E_BAD_TREE),  # root is not the pending next token
        (P.encode(P.VERIFY, {**fields, "temperature": 0.7}, {k: good[k] for k in ("tokens", "parents")}),
         P.E_BAD_TREE),
        (verify({"q_probs": good["q_probs"][:-1]}, temperature=0.7), P.E_BAD_TREE),
        (verify(with_("q_probs", (0, 0), np.nan), temperature=0.7), P.E_BAD_TREE),
        (verify(chain), P.E_LIMIT),
        (verify(session_id="no-such-session"), P.E_UNKNOWN_SESSION),
        (verify(seq=seq - 2), P.E_BAD_REQUEST),  # stale
        (P.encode(P.PREFILL, {"session_id": sid, "seq": seq}, {"tokens": np.ones(300, np.int32)}), P.E_LIMIT),
        (P.encode(P.PREFILL, {"session_id": sid, "seq": seq}, {"tokens": np.array([5, -1], np.int32)}),
         P.E_OUT_OF_VOCAB),
        (P.encode(P.PREFILL, {"session_id": sid, "seq": seq}, {"tokens": np.zeros(0, np.int32)}), P.E_BAD_REQUEST),
        (P.encode(P.RESUME, {"session_id": sid, "length": 10 ** 6, "policy": "keep"},
                  {"tokens": np.array([root], np.int32)}), P.E_UNKNOWN_SESSION),
        (P.encode(P.GENERATE, {"max_new_tokens": 1000, "temperature": 0, "top_p": 1.0, "top_k": 0, "drafter": "none"},
                  {"tokens": np.array(prompt, np.int32)}), P.E_LIMIT),
        (P.encode(P.HELLO, {"fingerprint": model.fingerprint, "client": "t", "row_dtype": "fp16"}), P.E_BAD_REQUEST),
    ]
    for bad, code in cases:
        reply = expect_error(c, bad, code)
        assert reply.fields["message"] and reply.fields["retry"] is False
    assert expect_error(c, verify(seq=seq - 2), P.E_BAD_REQUEST).fields["seq"] == seq - 2

    with Client(server.url, "bob") as other:  # bob cannot use alice's session
        other.hello(model.fingerprint)
        expect_error(other, verify(), P.E_FOREIGN_SESSION)
        assert "other credentials" in expect_error(other, P.encode(P.CLOSE, {"session_id": sid}),
                                                   P.E_FOREIGN_SESSION).fields["message"]
    with Client(server.url, "alice") as early:
        expect_error(early, verify(), P.E_BAD_REQUEST)  # before hello
    with Client(server.url, "alice") as wrong:
        fp = model.fingerprint.replace("memory=", "memory=0")
        reply = expect_error(wrong, P.encode(P.HELLO, {"fingerprint": fp, "client": "t", "row_dtype": "fp16"}),
                             P.E_FINGERPRINT)
        assert "memory differ" in reply.fields["message"]
        expect_closed(wrong, 1008)

    expect_error(c, raw_frame({"type": "verify", "v": 2, "fields": {}, "tensors": []}), P.E_VERSION)
    expect_closed(c, 1008)
    sc.client = Client(server.url, "alice")  # the session outlives the connection
    sc.client.hello(model.fingerprint)
    sc.apply(P.decode(sc.client.exchange(frame)))
    assert sc.continue_until(len(prompt), NEW, tiny.eos_token_ids) == vanilla[tuple(prompt)]
    sc.client.close()


def test_oversized_frame_is_refused(server, model):
    with Client(server.url, "alice") as c:
        c.hello(model.fingerprint)
        c.ws.send(bytes(LIMITS.max_message_bytes + 1))
        expect_closed(c, 1009)


# ---- auth, HTTP, CLI ----------------------------------------------------------------------------------------
def test_auth(server, model):
    with pytest.raises(InvalidStatus) as info:
        Client(server.url, "mallory")
    assert info.value.response.status_code == 401
    with Client(server.url) as c:  # no credentials at all
        expect_error(c, P.encode(P.HELLO, {"fingerprint": model.fingerprint, "client": "t", "row_dtype": "fp16"}),
                     P.E_AUTH)
        expect_closed(c, 1008)
    with Client(server.url) as c:  # credentials in hello instead of the handshake
        assert c.hello(model.fingerprint, auth="bob").type == P.WELCOME
    assert bearer("Bearer abc") == "abc" and bearer("Basic abc") is None and bearer(None) is None


def test_healthz_and_metrics(server):
    status, body = http_get(server.port, "/healthz")
    assert status == 200 and json.loads(body)["status"] == "ok"
    status, body = http_get(server.port, "/metrics")
    assert status == 200
    for name in ("moa_sessions", "moa_requests_total", "moa_accepted_tokens_total", "moa_target_seconds_total",
                 "moa_bytes_in_total", "moa_bytes_out_total", "moa_errors_total"):
        assert f"# TYPE {name} " in body
    assert http_get(server.port, "/")[0] == 426  # a plain HTTP request elsewhere is not a websocket


def test_config_and_tokens(tmp_path, monkeypatch):
    path = tmp_path / "tokens.txt"
    path.write_text("# ops\nalpha\n\nbeta\n")
    monkeypatch.setenv("MOA_TOKENS", "gamma, alpha")
    assert load_tokens(str(path)) == ("alpha", "beta", "gamma")
    cfg = parse_args(["--tokens-file", str(path), "--max-context", "100", "--port", "0"])
    assert cfg.tokens == ("alpha", "beta", "gamma") and cfg.limits.max_context == 100 and cfg.port == 0
    default = parse_args([])
    assert (default.target, default.drafter, default.host, default.port) == ("default", "default", "127.0.0.1", 8765)
    creds = Credentials(cfg.tokens)
    assert creds.owner("beta") and creds.owner("beta") != creds.owner("alpha") and creds.owner("zeta") is None
    assert Credentials().owner(None) == "open"


@pytest.mark.slow
def test_targets_load_from_the_local_cache_without_asking_the_network(monkeypatch, tmp_path):
    """Aliases, local directories and ids already in the Hugging Face cache load; a typo fails at once instead of
    after a hub's retries (half a minute on a machine without the hub)."""
    import socket

    import huggingface_hub.constants
    from models.registry import load_target
    from models.target import TargetLoadError, resolve_target_path

    lookups = []
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: lookups.append(a[0]) or [])
    for name in ("no/such-model", "not an id", str(tmp_path / "missing")):
        with pytest.raises(TargetLoadError, match="unknown model"):
            load_target(name)
    snapshot = tmp_path / "models--acme--smol" / "snapshots" / "abc123"  # the hub cache's layout
    snapshot.mkdir(parents=True)
    for f in Path(resolve_target_path("default")).iterdir():
        (snapshot / f.name).symlink_to(f)
    (tmp_path / "models--acme--smol" / "refs").mkdir()
    (tmp_path / "models--acme--smol" / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    assert load_target("acme/smol").name == "acme/smol"
    assert lookups == []


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_tls(model, tmp_path):
    cert, key = str(tmp_path / "cert.pem"), str(tmp_path / "key.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert, "-days",
                    "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"], check=True,
                   capture_output=True, timeout=120)
    config = parse_args(["--certfile", cert, "--keyfile", key])
    with ServerThread(App(model, Credentials(["t"])), ssl_context=config.ssl_context()) as srv:
        assert srv.url.startswith("wss://")
        with Client(srv.url, "t", ssl_context=ssl.create_default_context(cafile=cert)) as c:
            assert c.hello(model.fingerprint).type == P.WELCOME


def test_cli_serves(tiny):
    text = build_parser().format_help()
    assert all(s in text for s in ("--tokens-file", "--max-message-bytes", "--idle-timeout", "/metrics", "MOA_TOKENS"))
    server = ServerProcess(["--target", "tiny", "--drafter", "none", "--threads", "1"],
                           env={"OMP_NUM_THREADS": "1", "MOA_TOKENS": "k1"})
    with server:
        with Client(server.url, "k1") as c:
            welcome = c.hello(json.loads(http_get(server.port, "/healthz")[1])["fingerprint"])
            assert welcome.fields["row_width"] == 0
            assert c.generate([5, 6, 7], 5)[1].fields["tokens"] == \
                SpeculativeEngine(tiny, None).generate([5, 6, 7], max_new_tokens=5).token_ids
            with pytest.raises(ServerError, match="generate only"):
                c.call(P.PREFILL, {"seq": 1}, {"tokens": np.array([5, 6], np.int32)})
    assert server.proc.returncode == 0  # SIGTERM: a clean shutdown


# ---- concurrency, resume, expiry, limits --------------------------------------------------------------------
def test_concurrent_sessions_match_solo_runs(server, model, drafter, prompts, vanilla, tiny):
    results: dict[int, object] = {}

    def run(i: int) -> None:
        try:
            with Client(server.url, "alice" if i % 2 else "bob") as c:
                sc = edge(c, model, drafter)
                if i == 2:  # a server-side generation shares the compute lane with the verifies
                    results[i] = c.generate(prompts[i], NEW, "server")[1].fields["tokens"]
                else:
                    results[i] = sc.generate(prompts[i], NEW, tiny.eos_token_ids)
        except Exception as e:  # reported below
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert {i: results.get(i) for i in range(3)} == {i: vanilla[tuple(prompts[i])] for i in range(3)}


def test_resume_after_dropped_connection(server, model, drafter, prompts, vanilla, tiny):
    prompt = prompts[0]
    sc = edge(Client(server.url, "alice"), model, drafter)
    sc.prefill(prompt)
    sc.round()
    sc.client.close()  # link lost: the edge goes on alone with frozen memory
    sc.core.go_offline()
    for _ in range(4):
        sc.core.offline_token(0.0, None, None)
    offline = sc.core.tokens[sc.core.length:]  # the pending root and the offline tokens
    sc.client = Client(server.url, "alice")
    sc.client.hello(model.fingerprint)  # a new connection, the same session
    reply = sc.resume("verify")
    assert 1 <= reply.fields["accepted_upto"] <= len(offline) and reply.tensors["rows"].shape[0] == \
        reply.fields["accepted_upto"]
    assert sc.continue_until(len(prompt), NEW, tiny.eos_token_ids) == vanilla[tuple(prompt)]

    sc.core.go_offline()  # policy keep: whatever the edge showed becomes the transcript
    sc.core.tokens += [7, 8, 9]
    kept = sc.core.tokens[sc.core.length:]  # the pending root, 7, 8, 9
    reply = sc.resume("keep")
    assert reply.fields["accepted_upto"] == 4 and sc.committed[-4:] == kept
    expected = SpeculativeEngine(tiny, None).generate(list(sc.committed), max_new_tokens=12).token_ids
    assert sc.continue_until(len(sc.committed), 12, tiny.eos_token_ids) == expected
    sc.client.close()


def test_expired_session_and_max_sessions(model, drafter, prompts, vanilla, tiny):
    limits = Limits(max_sessions=2, max_context=256, max_tree_tokens=32, idle_timeout_s=0.3)
    with ServerThread(App(Model(tiny, drafter, limits, tree=str(TREE)))) as srv:  # open server
        prompt = prompts[1]
        sc = edge(Client(srv.url), model, drafter)
        sc.prefill(prompt)
        sc.round()
        sc.client.close()
        time.sleep(1.0)
        sc.client = c = Client(srv.url)
        welcome = c.hello(model.fingerprint)
        expect_error(c, P.encode(P.RESUME, {"session_id": sc.core.session_id, "length": sc.core.length,
                                            "policy": "keep"}, {"tokens": np.array([sc.core.pending], np.int32)}),
                     P.E_UNKNOWN_SESSION)
        expect_error(c, sc.core.verify_request(sc.rng).frame, P.E_UNKNOWN_SESSION)
        sc.link_session = welcome.fields["session_id"]  # lost session: re-feed the transcript to a new one
        sc.sync(lost=True)
        assert sc.continue_until(len(prompt), NEW, tiny.eos_token_ids) == vanilla[tuple(prompt)]

        second = Client(srv.url)
        second.hello(model.fingerprint)
        with Client(srv.url) as third:
            with pytest.raises(ServerError) as info:
                third.hello(model.fingerprint)
            assert info.value.code == P.E_BUSY and info.value.fields["retry"] is True
            second.close()  # its session was never used: it goes with the connection
            time.sleep(0.2)
            assert third.hello(model.fingerprint).type == P.WELCOME
        c.close()


# ---- the real default target --------------------------------------------------------------------------------
@pytest.mark.slow
def test_real_target_prefill_verify_equals_vanilla(real_target):
    from models.registry import build_drafter, load_drafter
    from models.defaults import DEFAULTS_DIR

    prompts = [real_target.encode_chat([{"role": "user", "content": q}])
               for q in ("What is the capital of France?", "Write a Python function that adds two numbers.")]
    engine = SpeculativeEngine(real_target, None)
    expected = [engine.generate(p, max_new_tokens=24).token_ids for p in prompts]
    shipped = (DEFAULTS_DIR / "moa" / "config.json").exists()
    drafter = load_drafter("default", real_target) if shipped else build_drafter("moa", real_target)  # any head works
    model = Model(real_target, drafter, Limits(max_context=1024))
    with ServerThread(App(model)) as srv, Client(srv.url) as c:
        sc = edge(c, model, drafter)
        for p, want in zip(prompts, expected):
            assert sc.generate(p, 24, real_target.eos_token_ids) == want
