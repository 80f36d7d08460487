"""The verify server under fuzzing, faults and load, as a real process on loopback (tiny random target, an untrained
MoA memory head: greedy output must not depend on the drafter, so any drafter will do).

- Fuzz: seeded random and mutated frames of every message type; every frame gets a typed error (never `internal`)
  or a valid reply, the server stays up, and afterwards the fuzzed session generates exactly what a fresh one does.
- Faults: a connection cut mid-frame, a partial frame held open, an oversized frame, no hello, an internal error
  half-way through a verify (injected into an in-process server): nobody else is disturbed, no session is lost.
- Load and isolation: clients in parallel with a long prompt and held connections give the outputs of solo runs; a
  4,000-token prefill does not hold the compute lane; per-credential quota; one credential never touches another's
  session; /metrics and /healthz expose no prompt text, token text, session id or credential.
"""

from __future__ import annotations

import json
import os
import random
import socket
import struct
import threading
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import torch
from websockets.exceptions import ConnectionClosed

from moa_core import protocol as P
from moa_core.tree import TreeConfig
from models.registry import build_drafter, load_drafter, load_target
from models.engine import SpeculativeEngine, TorchDraftStep
from server.app import App
from server.config import Limits
from server.process import ServerProcess
from server.session import Model
from server.testing import Client, ServerThread
from tests.helpers import CoreClient

TOKENS = [f"token-{i}" for i in range(17)]
ALICE, BOB, LOAD, HELD, QUOTA_TOKEN = TOKENS[0], TOKENS[1], TOKENS[2:6], TOKENS[6:16], TOKENS[16]
TREE = TreeConfig(3, 2, 6)
NEW = 24
QUOTA = 32
MAX_BYTES = 1 << 20
FUZZ_CASES = int(os.environ.get("MOA_FUZZ_CASES", "4000"))
TYPED = set(P.ERROR_CODES) - {P.E_INTERNAL}
WAIT_S = 120.0  # bounds every receive; no timing assertion


@pytest.fixture(scope="module")
def target():
    torch.set_num_threads(1)
    return load_target("tiny", dtype="float32")  # the very model `--target tiny` serves


@pytest.fixture(scope="module")
def drafter_dir(target, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("robust") / "drafter"
    torch.manual_seed(0)
    build_drafter("moa", target).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def step(target, drafter_dir) -> TorchDraftStep:
    return TorchDraftStep(load_drafter(drafter_dir, target))


@pytest.fixture(scope="module")
def server(drafter_dir) -> Iterator[ServerProcess]:
    args = ["--target", "tiny", "--drafter", str(drafter_dir), "--threads", "1", "--log-level", "error",
            "--max-context", "4200", "--max-tree-tokens", "32", "--max-message-bytes", str(MAX_BYTES),
            "--max-sessions", "256", "--max-sessions-per-token", str(QUOTA), "--hello-timeout", "2",
            "--prefill-chunk", "64"]
    with ServerProcess(args, env={"OMP_NUM_THREADS": "1", "MOA_TOKENS": ",".join(TOKENS)}) as srv:
        yield srv


@pytest.fixture(scope="module")
def fingerprint(server) -> str:
    return health(server)["fingerprint"]


def http(server: ServerProcess, path: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}{path}", timeout=30) as r:
        return r.read().decode()


def health(server: ServerProcess) -> dict:
    return json.loads(http(server, "/healthz"))


def prompt(i: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(100 + i).integers(3, 90, 8)]


def edge(server: ServerProcess, token: str, fingerprint: str, step: TorchDraftStep) -> CoreClient:
    client = Client(server.url, token, timeout=WAIT_S)
    return CoreClient(client, client.hello(fingerprint).fields["session_id"], step, step.drafter.row_width, TREE)


def solo(server, fingerprint, step, p: list[int], token: str = ALICE) -> list[int]:
    """A greedy speculative generation in a session of its own, closed afterwards."""
    sc = edge(server, token, fingerprint, step)
    try:
        return sc.generate(p, NEW, set())
    finally:
        sc.client.ws.send(P.encode(P.CLOSE, {"session_id": sc.core.session_id}))
        sc.client.close()


# ---- fuzz -----------------------------------------------------------------------------------------------------
VALUES = [None, True, False, 0, -1, 1, 7, 2 ** 31, 2 ** 62, 2 ** 63, -2 ** 63 - 1, 10 ** 30, 0.5, -0.0, 1e-300, 5e-324,
          1e308, "", "x", "verify", "é" * 40, [], [1, 2], [[[]]], {}, {"a": {"b": [None]}}]


def raw(header: Any, payload: bytes = b"") -> bytes:
    h = json.dumps(header).encode()
    return P.MAGIC + struct.pack("<I", len(h)) + h + payload


def deep_frame() -> bytes:
    """A header of 200,000 nested lists."""
    text = b"[" * 200_000 + b"]" * 200_000
    return struct.pack("<4sI", P.MAGIC, len(text)) + text


def header_of(frame: bytes) -> tuple[dict, bytes]:
    n = struct.unpack_from("<I", frame, 4)[0]
    return json.loads(frame[8:8 + n]), frame[8 + n:]


class Fuzzer:
    """Seeded frames for one session: valid ones built from what the session holds now, then mutated."""

    def __init__(self, seed: int, session_id: str, fingerprint: str, vocab: int):
        self.rng = random.Random(seed)
        self.sid, self.fingerprint, self.vocab = session_id, fingerprint, vocab
        self.seq, self.pending, self.length = 1, None, 0

    def ids(self, n: int, spread: int = 0) -> np.ndarray:
        return np.array([self.rng.randrange(-spread, self.vocab + spread) for _ in range(n)], np.int32)

    def base(self) -> bytes:
        """A valid frame of a random client type (or a server type, which the server must refuse)."""
        r, sid = self.rng, self.sid
        kind = r.choice([P.HELLO, P.PREFILL, P.VERIFY, P.VERIFY, P.RESUME, P.GENERATE, P.CLOSE, P.PING, P.WELCOME,
                         P.DONE])
        sampling = {"temperature": r.choice([0, 0, 0.7]), "top_p": 1.0, "top_k": 0}
        if kind == P.PREFILL:
            return P.encode(kind, {"session_id": sid, "seq": self.seq + 1}, {"tokens": self.ids(r.randint(1, 12))})
        if kind == P.VERIFY:
            n = r.randint(0, 6)
            root = self.pending if self.pending is not None else 0
            tensors = {"tokens": np.concatenate([[root], self.ids(n)]).astype(np.int32),
                       "parents": np.array([-1] + [r.randrange(0, i + 1) for i in range(n)], np.int32)}
            if sampling["temperature"]:
                q = np.random.default_rng(r.randrange(1 << 30)).dirichlet(np.ones(3), n + 1).astype(np.float32)
                tensors.update(q_ids=self.ids(3 * (n + 1)).reshape(n + 1, 3), q_probs=q * 0.99)
            return P.encode(kind, {"session_id": sid, "seq": self.seq + 1, **sampling}, tensors)
        if kind == P.RESUME:
            return P.encode(kind, {"session_id": sid, "length": r.randint(0, self.length + 1),
                                   "policy": r.choice(["keep", "verify"])}, {"tokens": self.ids(r.randint(1, 5))})
        if kind == P.GENERATE:
            return P.encode(kind, {"max_new_tokens": r.randint(1, 4), **sampling, "drafter": r.choice(["none", "server"]),
                                   "seed": r.randrange(1 << 20)}, {"tokens": self.ids(r.randint(1, 6))})
        if kind == P.HELLO:
            return P.encode(kind, {"fingerprint": self.fingerprint, "client": "fuzz", "row_dtype": "fp16"})
        if kind == P.CLOSE:
            return P.encode(kind, {"session_id": "no-such-session"})
        if kind == P.PING:
            return P.encode(kind, {"t": r.random()})
        if kind == P.WELCOME:
            return P.encode(kind, {"session_id": sid, "limits": {}, "target": "t", "fingerprint": "f", "vocab_size": 1,
                                   "row_width": 1, "row_dtype": "fp16"})
        return P.encode(kind, {"tokens": [1], "text": "", "finish_reason": "eos", "stats": {}})

    def mutate(self, frame: bytes) -> bytes | str:
        r = self.rng
        how = r.choices(range(9), weights=[1, 1, 1, 1, 4, 2, 1, 2, 1])[0]
        if how == 0:  # as it is
            return frame
        if how == 1:  # random bytes, sometimes behind a valid prefix
            junk = bytes(r.randrange(256) for _ in range(r.randint(0, 64)))
            return r.choice([junk, P.MAGIC + junk, frame[:8] + junk])
        if how == 2:  # truncated
            return frame[:r.randrange(len(frame))]
        if how == 3:  # flipped bytes
            b = bytearray(frame)
            for _ in range(r.randint(1, 4)):
                b[r.randrange(len(b))] ^= 1 << r.randrange(8)
            return bytes(b)
        header, payload = header_of(frame)
        if how == 4:  # a field set to a random value, deleted, or added
            fields = header["fields"]
            key = r.choice(list(fields) + ["extra", "seq", "session_id"])
            if r.random() < 0.2:
                fields.pop(key, None)
            else:
                fields[key] = r.choice(VALUES)
        elif how == 5:  # the tensor table: dtype, shape, offset, nbytes, name
            if not header["tensors"]:
                header["tensors"].append({"name": "tokens", "dtype": "int32", "shape": [1], "offset": 0, "nbytes": 4})
            entry = r.choice(header["tensors"])
            key = r.choice(["dtype", "shape", "offset", "nbytes", "name"])
            entry[key] = r.choice(VALUES + ["float64", "int32", "float16", [2, 2], [1] * 100, [-1], [2 ** 40] * 2])
        elif how == 6:  # top-level header keys
            key = r.choice(["type", "v", "fields", "tensors"])
            header[key] = r.choice(VALUES + list(P.MESSAGE_TYPES) + ["bye"])
        elif how == 7:  # payload bytes changed, table kept: random token ids and parents, NaN probabilities
            payload = bytes(r.randrange(256) for _ in payload)
        else:  # pathological headers
            return r.choice([deep_frame(), raw({"type": "ping", "v": 1, "fields": {"t": 0}}).replace(b"0}", b"1e400}"),
                             raw(json.loads("[" * 50 + "]" * 50)), raw({"type": "ping", "v": 1, "tensors": {}}),
                             "a text frame", b""])
        return raw(header, payload)


def exchange(client: Client, frame: bytes | str, mark: float) -> list[P.Message]:
    """Send a frame, then a ping; the replies up to its pong (a close has none)."""
    client.ws.send(frame)
    client.ws.send(P.encode(P.PING, {"t": mark}))
    replies = []
    while True:
        msg = P.decode(client.ws.recv(WAIT_S))
        P.validate(msg)
        if msg.type == P.PONG and msg.fields.get("t") == mark:
            return replies
        replies.append(msg)


def is_close(frame: bytes | str) -> bool:
    try:
        msg = P.decode(frame)
        P.validate(msg)
    except P.ProtocolError:
        return False
    return msg.type == P.CLOSE


def test_fuzzed_frames_get_typed_errors_and_the_session_goes_on(server, fingerprint, step, target):
    anchor = Client(server.url, ALICE, timeout=WAIT_S)  # holds the fuzzed session while fuzz connections come and go
    sid = anchor.hello(fingerprint).fields["session_id"]
    client = Client(server.url, ALICE, timeout=WAIT_S)
    client.hello(fingerprint)
    fuzz = Fuzzer(0, sid, fingerprint, target.spec.vocab_size)
    codes: dict[str, int] = {}
    sent = closes = 0
    while sent < FUZZ_CASES:
        frame = fuzz.mutate(fuzz.base())
        if is_close(frame):  # a valid close would end the session this test checks at the end
            continue
        sent += 1
        try:
            replies = exchange(client, frame, float(sent))
        except ConnectionClosed as e:  # version/fingerprint/auth (1008), over max_message_bytes (1009)
            assert e.rcvd is not None and e.rcvd.code in (1008, 1009), e
            closes += 1
            client = Client(server.url, ALICE, timeout=WAIT_S)
            client.hello(fingerprint)
            continue
        for msg in replies:
            if msg.type == P.ERROR:
                assert msg.fields["code"] in TYPED, msg.fields
                codes[msg.fields["code"]] = codes.get(msg.fields["code"], 0) + 1
            else:
                codes[msg.type] = codes.get(msg.type, 0) + 1
            if msg.type in (P.PREFILLED, P.VERIFIED, P.RESUMED):
                fuzz.pending, fuzz.length = msg.fields["next_token"], msg.fields["length"]
                fuzz.seq = max(fuzz.seq, msg.fields.get("seq", 0))
    print(f"\nfuzz: {sent} frames, {closes} connections closed by the server, replies by code: {codes}")
    assert health(server)["status"] == "ok" and codes.get(P.VERIFIED) and codes.get(P.PREFILLED)

    client.close()
    fuzzed = CoreClient(anchor, sid, step, step.drafter.row_width, TREE, seq=2 ** 63 - 100)  # above any fuzzed seq
    assert fuzzed.generate(prompt(0), NEW, set()) == solo(server, fingerprint, step, prompt(0))
    anchor.close()


def test_named_bad_inputs(server, fingerprint, step):
    """The cases of issue 14: each typed, none ending the session or the connection."""
    sc = edge(server, ALICE, fingerprint, step)
    c = sc.client
    sc.prefill(prompt(1))
    sc.round()
    cases = [(raw({"type": "ping", "v": 1, "fields": {}, "tensors": [
        {"name": "x", "dtype": "int8", "shape": [1] * 100, "offset": 0, "nbytes": 1}]}, b"\0"), P.E_TENSOR_MISMATCH),
             (deep_frame(), P.E_MALFORMED),
             (raw({"type": "ping", "v": 1, "fields": {}}).replace(b"{}", b'{"t": 1e400}'), P.E_MALFORMED),
             (raw({"type": "ping", "v": 1, "fields": {}}).replace(b"{}", b'{"t": 1' + b"0" * 30 + b"}"), P.E_MALFORMED),
             (P.encode(P.PREFILL, {"session_id": sc.core.session_id, "seq": sc.core.seq},
                       {"tokens": np.array([5], np.int32)}), P.E_BAD_REQUEST),  # the seq of the last verify
             (P.encode(P.PREFILL, {"session_id": sc.core.session_id, "seq": sc.core.seq + 1, "temperature": 5e-324},
                       {"tokens": np.array([5, 6], np.int32)}), P.E_BAD_REQUEST)]
    for frame, code in cases:
        reply = P.decode(c.exchange(frame))
        assert reply.type == P.ERROR and reply.fields["code"] == code, (code, reply.fields)
    assert sc.continue_until(len(prompt(1)), NEW, set()) == solo(server, fingerprint, step, prompt(1))

    c.ws.send(P.encode(P.CLOSE, {}))  # the connection's own session: it may say hello again
    welcome = c.hello(fingerprint)
    assert welcome.fields["session_id"] != sc.core.session_id
    sc.link_session = welcome.fields["session_id"]
    assert sc.generate(prompt(1), NEW, set()) == solo(server, fingerprint, step, prompt(1))
    c.close()


def test_internal_error_half_way_keeps_the_session(target, drafter_dir, step):
    """A failing device, injected in the memory head after the target forward of a verify (in-process server)."""
    drafter = load_drafter(drafter_dir, target)
    model = Model(target, drafter, Limits(max_context=256, max_tree_tokens=32))
    rows, fail = model.memory_head.memory_rows, {"left": 1}

    def failing(*args: Any) -> np.ndarray:
        if fail["left"]:
            fail["left"] -= 1
            raise RuntimeError("device lost")
        return rows(*args)

    expected = SpeculativeEngine(target, None).generate(prompt(2), max_new_tokens=NEW).token_ids
    with ServerThread(App(model)) as srv, Client(srv.url) as c:
        sc = CoreClient(c, c.hello(model.fingerprint).fields["session_id"], step, drafter.row_width, TREE)
        sc.prefill(prompt(2))
        sc.round()
        frame = sc.core.verify_request(sc.rng).frame
        model.memory_head.memory_rows = failing
        reply = P.decode(c.exchange(frame))
        assert reply.fields["code"] == P.E_INTERNAL and reply.fields["retry"] is True, reply.fields
        sc.apply(P.decode(c.exchange(frame)))  # the same request again: the session is as it was
        assert sc.continue_until(len(prompt(2)), NEW, set()) == expected


# ---- faults on connections ------------------------------------------------------------------------------------
def partial_frame(client: Client) -> None:
    """Write the start of a masked binary frame that announces 1,000 bytes and stop after 10 of them."""
    client.ws.socket.sendall(bytes([0x82, 0x80 | 126]) + struct.pack(">H", 1000) + os.urandom(4) + bytes(10))


def reset(client: Client) -> None:
    client.ws.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    client.ws.socket.close()


def test_long_prefill_does_not_hold_the_compute_lane(server, fingerprint, step):
    """A 4,000-token prefill (within limits) and another client's verify: the verify is answered first."""
    sc = edge(server, BOB, fingerprint, step)
    sc.prefill(prompt(3))
    frame = sc.core.verify_request(sc.rng).frame
    with Client(server.url, ALICE, timeout=WAIT_S) as hog:
        hog.hello(fingerprint)
        hog.ws.send(P.encode(P.PREFILL, {"seq": 1}, {"tokens": np.arange(4000, dtype=np.int32) % 90 + 3}))
        for _ in range(10_000):  # until the prefill is in the compute lane
            if health(server)["queue"]:
                break
        sc.apply(P.decode(sc.client.exchange(frame)))
        with pytest.raises(TimeoutError):
            hog.ws.recv(0)  # the long prefill is still running
        assert P.decode(hog.ws.recv(WAIT_S)).type == P.PREFILLED
    sc.client.close()


def test_clients_in_parallel_match_solo_runs_under_load_and_faults(server, fingerprint, step):
    clients = 4
    solos = [solo(server, fingerprint, step, prompt(10 + i), LOAD[i]) for i in range(clients)]
    held = [Client(server.url, HELD[i % len(HELD)], timeout=WAIT_S) for i in range(40)]
    for c in held:
        c.hello(fingerprint)
    results: dict[int, Any] = {}
    stop = threading.Event()

    def run(i: int) -> None:
        try:
            results[i] = solo(server, fingerprint, step, prompt(10 + i), LOAD[i])
        except Exception as e:  # reported by the assertion below
            results[i] = e

    def long_prompts() -> None:
        with Client(server.url, BOB, timeout=WAIT_S) as c:
            c.hello(fingerprint)
            seq = 0
            while not stop.is_set():
                seq += 1
                c.call(P.PREFILL, {"seq": seq}, {"tokens": np.arange(2000, dtype=np.int32) % 90 + 3})

    fault_errors: list[BaseException] = []

    def faults() -> None:
        try:
            loris = [Client(server.url, BOB, timeout=WAIT_S) for _ in range(5)]
            for c in loris:  # partial frames held open, never a hello: closed at the hello timeout
                partial_frame(c)
            for i in range(15):
                c = Client(server.url, BOB, timeout=WAIT_S)
                if i % 3 == 0:  # oversized: closed with 1009
                    c.ws.send(bytes(MAX_BYTES + 1))
                elif i % 3 == 1:  # cut mid-frame
                    c.hello(fingerprint)
                    partial_frame(c)
                reset(c)  # else: a reset right after the handshake
            for c in loris:
                with pytest.raises(ConnectionClosed):
                    while True:
                        c.ws.recv(WAIT_S)
        except BaseException as e:  # reported below
            fault_errors.append(e)

    workers = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
    background = [threading.Thread(target=long_prompts), threading.Thread(target=faults)]
    for t in background + workers:
        t.start()
    for t in workers:
        t.join(600)
    stop.set()
    for t in background:
        t.join(600)
    assert health(server)["connections"] >= len(held)
    for c in held:
        c.close()
    assert [results.get(i) for i in range(clients)] == solos and not fault_errors
    print(f"\nload: {clients} clients + 1 long-prompt client + {len(held)} held connections + 20 faulty connections")


def test_no_hello_is_closed(server):
    with Client(server.url, ALICE, timeout=WAIT_S) as c:
        with pytest.raises(ConnectionClosed) as info:
            c.ws.recv(WAIT_S)
        assert info.value.rcvd is not None and info.value.rcvd.code == 1008


# ---- credentials ----------------------------------------------------------------------------------------------
def test_quota_and_isolation_between_credentials(server, fingerprint, step):
    mine = edge(server, QUOTA_TOKEN, fingerprint, step)
    mine.prefill(prompt(4))
    sid = mine.core.session_id
    extra = [Client(server.url, QUOTA_TOKEN, timeout=WAIT_S) for _ in range(QUOTA - 1)]
    for c in extra:
        c.hello(fingerprint)
    with Client(server.url, QUOTA_TOKEN, timeout=WAIT_S) as over:
        reply = over.request(P.HELLO, {"fingerprint": fingerprint, "client": "t", "row_dtype": "fp16"})
        assert reply.fields["code"] == P.E_BUSY and reply.fields["retry"] is True and "sessions" in reply.fields["message"]
    with Client(server.url, BOB, timeout=WAIT_S) as other:  # another credential is not held back, nor let in
        other.hello(fingerprint)
        tree = {"tokens": np.array([mine.core.pending], np.int32), "parents": np.array([-1], np.int32)}
        for msg_type, fields, tensors in [
                (P.VERIFY, {"session_id": sid, "seq": 10 ** 6, "temperature": 0, "top_p": 1.0, "top_k": 0}, tree),
                (P.PREFILL, {"session_id": sid, "seq": 10 ** 6}, {"tokens": np.array([5], np.int32)}),
                (P.RESUME, {"session_id": sid, "length": 1, "policy": "keep"}, {"tokens": np.array([5], np.int32)}),
                (P.CLOSE, {"session_id": sid}, None)]:
            reply = other.request(msg_type, fields, tensors)
            assert reply.fields["code"] == P.E_FOREIGN_SESSION, reply.fields
    for c in extra:
        c.close()
    assert mine.continue_until(len(prompt(4)), NEW, set()) == solo(server, fingerprint, step, prompt(4))
    mine.client.close()


def test_metrics_and_healthz_expose_no_prompt_tokens_or_secrets(server, fingerprint, step, target):
    text = "secret prompt text"
    ids = target.tokenizer.encode(text)
    with Client(server.url, ALICE, timeout=WAIT_S) as c:
        sid = c.hello(fingerprint).fields["session_id"]
        pieces, done = c.generate(ids, 12)
        c.call(P.PREFILL, {"seq": 1}, {"tokens": np.array(ids, np.int32)})
        bodies = http(server, "/metrics") + http(server, "/healthz")
    generated = done.fields["text"]
    for secret in [text, sid, *TOKENS] + ([generated] if len(generated) >= 6 else []):
        assert secret not in bodies
    assert ",".join(map(str, ids)) not in bodies.replace(" ", "")
