"""Helpers for tests and benchmarks: a server in a background thread, a small synchronous protocol client and the
edge's speculative loop in its simplest form. The real edge client is `edge_client.client`."""

from __future__ import annotations

import asyncio
import ssl
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from websockets.sync.client import ClientConnection, connect

from moa_core import protocol as P
from moa_core.drafting import DraftSession, DraftStep
from moa_core.generation import StopRule
from moa_core.tree import TreeConfig
from server.app import App


class ServerThread:
    """`with ServerThread(app) as server:` serves `app` on a loopback port (any free one) until the block ends."""

    def __init__(self, app: App, host: str = "127.0.0.1", port: int = 0, ssl_context: ssl.SSLContext | None = None):
        self.app, self.host, self.port, self.ssl_context = app, host, port, ssl_context
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True, name="moa-server")

    @property
    def url(self) -> str:
        return f"{'wss' if self.ssl_context else 'ws'}://{self.host}:{self.port}"

    async def _main(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        try:
            async with self.app.serve(self.host, self.port, self.ssl_context) as server:
                self.port = server.sockets[0].getsockname()[1]
                self._ready.set()
                await self._stop.wait()
        except BaseException as e:
            self._error = e
            self._ready.set()

    def __enter__(self) -> "ServerThread":
        self._thread.start()
        self._ready.wait(60)
        if self._error is not None or not self._ready.is_set():
            raise RuntimeError(f"the server did not start: {self._error!r}")
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)


class ServerError(Exception):
    """An `error` reply."""

    def __init__(self, msg: P.Message):
        super().__init__(f"{msg.fields['code']}: {msg.fields['message']}")
        self.code: str = msg.fields["code"]
        self.fields = msg.fields


class Client:
    """A blocking protocol client over one websocket connection."""

    def __init__(self, url: str, token: str | None = None, timeout: float = 120.0,
                 ssl_context: ssl.SSLContext | None = None):
        headers = {"Authorization": f"Bearer {token}"} if token else None
        self.ws: ClientConnection = connect(url, additional_headers=headers, max_size=None, open_timeout=timeout,
                                            compression=None, ssl=ssl_context, legacy=True)
        self.timeout = timeout

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.ws.close()

    def exchange(self, frame: bytes | str) -> bytes:
        """Send one raw frame, return the raw reply."""
        self.ws.send(frame)
        return self.ws.recv(self.timeout)

    def recv(self) -> P.Message:
        return P.decode(self.ws.recv(self.timeout))

    def request(self, msg_type: str, fields: dict[str, Any] | None = None,
                tensors: dict[str, np.ndarray] | None = None) -> P.Message:
        """Send a message, return the reply (an `error` too)."""
        return P.decode(self.exchange(P.encode(msg_type, fields, tensors)))

    def call(self, msg_type: str, fields: dict[str, Any] | None = None,
             tensors: dict[str, np.ndarray] | None = None) -> P.Message:
        """Like request, but an `error` reply raises ServerError."""
        reply = self.request(msg_type, fields, tensors)
        if reply.type == P.ERROR:
            raise ServerError(reply)
        return reply

    def hello(self, fingerprint: str, row_dtype: str = "fp16", auth: str | None = None) -> P.Message:
        """The `welcome` reply (ServerError otherwise)."""
        fields = {"fingerprint": fingerprint, "client": "server.testing", "row_dtype": row_dtype}
        return self.call(P.HELLO, {**fields, "auth": auth} if auth else fields)

    def generate(self, prompt: list[int], max_new_tokens: int, drafter: str = "none", temperature: float = 0.0,
                 seed: int | None = None) -> tuple[list[str], P.Message]:
        """Server-side generation: the streamed text pieces and the `done` message."""
        self.ws.send(P.encode(P.GENERATE, {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": 1.0,
                                           "top_k": 0, "drafter": drafter, "seed": seed},
                              {"tokens": np.asarray(prompt, np.int32)}))
        pieces = []
        while (msg := self.recv()).type == P.TOKEN:
            pieces.append(msg.fields["text"])
        if msg.type == P.ERROR:
            raise ServerError(msg)
        return pieces, msg


@dataclass
class SpeculativeClient:
    """The edge's loop: draft a tree with a `DraftSession`, verify it on the server, append what was accepted."""

    client: Client
    session_id: str
    step: DraftStep
    tree: TreeConfig
    temperature: float = 0.0
    seed: int = 0
    tokens: list[int] = field(default_factory=list)  # committed transcript
    rows: list[np.ndarray] = field(default_factory=list)  # memory rows of the committed tokens
    root: int | None = None  # the pending next token
    seq: int = 0
    verifies: int = 0
    draft: DraftSession | None = None

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.seed)

    def _sampling(self) -> dict[str, Any]:
        return {"temperature": self.temperature, "top_p": 1.0, "top_k": 0}

    def _commit(self, tokens: list[int], reply: P.Message) -> None:
        rows = P.decode_rows(reply.tensors)
        self.tokens += tokens
        self.rows.append(rows)
        self.root = reply.fields["next_token"]
        assert reply.fields["length"] == len(self.tokens), (reply.fields, len(self.tokens))

    def rebuild(self) -> None:
        """A fresh drafter state over the committed transcript (after a rewind)."""
        self.draft = DraftSession(self.step)
        self.draft.add_verified(self.tokens, np.concatenate(self.rows))

    def prefill(self, prompt: list[int]) -> None:
        self.seq += 1
        reply = self.client.call(P.PREFILL, {"session_id": self.session_id, "seq": self.seq, **self._sampling()},
                                 {"tokens": np.asarray(prompt, np.int32)})
        self.tokens, self.rows = [], []
        self._commit(list(prompt), reply)
        self.rebuild()

    def verify_frame(self) -> tuple[bytes, Any]:
        """The next verify request (and its tree); the seq is used up."""
        tree = self.draft.draft(self.root, self.tree, self.temperature, self.rng)
        self.seq += 1
        fields = {"session_id": self.session_id, "seq": self.seq, **self._sampling()}
        return P.encode(P.VERIFY, fields, P.encode_tree(self.root, tree, with_q=self.temperature > 0)), tree

    def apply(self, tree: Any, reply: P.Message) -> None:
        """Take a `verified` reply for `tree`."""
        if reply.type == P.ERROR:
            raise ServerError(reply)
        path = [i - 1 for i in reply.fields["accepted"][1:]]
        new = [self.root] + [int(tree.tokens[i]) for i in path]
        self.draft.accept(tree, self.root, path, P.decode_rows(reply.tensors))
        self._commit(new, reply)
        self.verifies += 1

    def round(self) -> None:
        frame, tree = self.verify_frame()
        self.apply(tree, P.decode(self.client.exchange(frame)))

    def resume(self, offline: list[int], policy: str) -> P.Message:
        """Send `offline` tokens (pending root first) made since the committed length; rewind to what was kept."""
        reply = self.client.call(P.RESUME, {"session_id": self.session_id, "length": len(self.tokens),
                                            "policy": policy, **self._sampling()},
                                 {"tokens": np.asarray(offline, np.int32)})
        self._commit(offline[:reply.fields["accepted_upto"]], reply)
        self.rebuild()
        return reply

    def continue_until(self, prompt_len: int, max_new_tokens: int, eos: set[int]) -> list[int]:
        """Verify rounds until max_new_tokens or EOS; the generated tokens."""
        while len(self.tokens) - prompt_len < max_new_tokens and not eos & set(self.tokens[prompt_len:]):
            self.round()
        return StopRule(eos).cut(self.tokens[prompt_len:], max_new_tokens)[0]

    def generate(self, prompt: list[int], max_new_tokens: int, eos: set[int]) -> list[int]:
        self.prefill(prompt)
        return self.continue_until(len(prompt), max_new_tokens, eos)
