"""Helpers for tests and benchmarks: a server in a background thread and a small synchronous protocol client. The
edge's session state and requests are `edge_client.core.EdgeCore`; its client is `edge_client.client`."""

from __future__ import annotations

import asyncio
import ssl
import threading
from typing import Any

import numpy as np
from websockets.sync.client import ClientConnection, connect

from moa_core import protocol as P
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
                 seed: int | None = None, copy_tokens: int | None = None, session_id: str | None = None,
                 streamed: list[int] | None = None) -> tuple[list[str], P.Message]:
        """Server-side generation: the streamed text pieces and the `done` message; `streamed` gets the streamed
        token ids; `session_id` names a session whose cache it may continue."""
        copy = {} if copy_tokens is None else {"copy_tokens": copy_tokens}
        self.ws.send(P.encode(P.GENERATE, {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": 1.0,
                                           "top_k": 0, "drafter": drafter, "seed": seed, "session_id": session_id,
                                           **copy},
                              {"tokens": np.asarray(prompt, np.int32)}))
        pieces = []
        while (msg := self.recv()).type == P.TOKEN:
            pieces.append(msg.fields["text"])
            if streamed is not None:
                streamed.extend(msg.fields["tokens"])
        if msg.type == P.ERROR:
            raise ServerError(msg)
        return pieces, msg
