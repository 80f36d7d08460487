"""The websocket + HTTP front of the verify server (protocol: docs/protocol.md).

One asyncio event loop handles every connection; it never runs model code. Model work goes to executor threads.
With batching (the default) they run side by side and their target forwards meet in the model's batcher
(models/batching.py): forwards of sessions ready at the same moment (verifies, prefill chunks, generate's decode
steps) run as one. Without, they pass through one FIFO ticket lock, the compute lane: one computation at a time, in
arrival order; `generate` gives the lane back after every decoding round, and a long prefill or resume after every
chunk, so that verifies of other sessions are not stuck behind them. One operation per session runs at a time. A
connection that sends no hello within `hello_timeout_s` is closed. GET /healthz and GET /metrics share the websocket
port.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, AsyncIterator, Awaitable, Callable

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from moa_core import protocol as P
from server.auth import Credentials, bearer
from server.session import Model, Session, no_pause, sampling_of

log = logging.getLogger("moa.server")
FATAL = (P.E_VERSION, P.E_FINGERPRINT, P.E_AUTH)  # these errors close the connection (code 1008)
CLOSE_POLICY = 1008


class FairLock:
    """A FIFO (ticket) lock: threads get it in the order they asked for it."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._next = 0
        self._serving = 0

    def __enter__(self) -> None:
        with self._cond:
            ticket = self._next
            self._next += 1
            self._cond.wait_for(lambda: self._serving == ticket)

    def __exit__(self, *exc: object) -> None:
        with self._cond:
            self._serving += 1
            self._cond.notify_all()

    def yield_turn(self) -> None:
        """Let every thread already waiting go first, then continue (called while holding the lock)."""
        self.__exit__()
        self.__enter__()

    @property
    def depth(self) -> int:
        """Computations running or waiting."""
        return self._next - self._serving


class Cancelled(Exception):
    """A generation whose client went away."""


@dataclass
class Connection:
    ws: ServerConnection
    owner: str | None  # from the handshake's bearer token; else set by hello.auth
    session_id: str | None = None  # the session from `welcome`; None until hello
    attached: set[str] = field(default_factory=set)  # sessions used on this connection


class App:
    """Sessions, authentication, dispatch and metrics around a `Model`."""

    def __init__(self, model: Model, credentials: Credentials = Credentials()):
        self.model = model
        self.limits = model.limits
        self.credentials = credentials
        self.sessions: dict[str, Session] = {}
        self.connections = 0
        self.lane = FairLock()
        self.batcher = model.batcher  # None: the FIFO lane
        self.pause = self.lane.yield_turn if self.batcher is None else no_pause  # between chunks and rounds
        self._busy = threading.Lock()
        self._in_flight = 0
        self._busy_since = 0.0
        # threads wait for the lane or the batcher; enough of them that a waiting request never waits for a thread
        self.executor = ThreadPoolExecutor(self.limits.max_sessions + 4, thread_name_prefix="moa-compute")
        self.handlers: dict[str, Callable[[Connection, P.Message], Awaitable[None]]] = {
            P.HELLO: self.on_hello, P.PREFILL: self.on_prefill, P.VERIFY: self.on_verify, P.RESUME: self.on_resume,
            P.GENERATE: self.on_generate, P.CLOSE: self.on_close, P.PING: self.on_ping}

    # ---- lifecycle -----------------------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def serve(self, host: str, port: int, ssl_context=None) -> AsyncIterator[Server]:
        """Listen on host:port (port 0: any free port) until the context exits."""
        if self.credentials.open:
            log.warning("no auth tokens configured: the server is open to every client that can reach it")
        sweeper = asyncio.create_task(self._sweep())
        try:
            async with serve(self.handle, host, port, process_request=self.process_request, ssl=ssl_context,
                             max_size=self.limits.max_message_bytes, compression=None) as server:
                bound = server.sockets[0].getsockname()
                log.info("serving %s on %s://%s:%s (fingerprint %s)", self.model.target.label,
                         "wss" if ssl_context else "ws", bound[0], bound[1], self.model.fingerprint)
                yield server
        finally:
            sweeper.cancel()
            self.executor.shutdown(wait=False, cancel_futures=True)

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(min(5.0, max(0.05, self.limits.idle_timeout_s / 4)))
            self.reap()

    def reap(self) -> None:
        """Drop sessions that no connection uses and that were idle longer than the idle timeout."""
        now = time.monotonic()
        for sid, s in list(self.sessions.items()):
            if s.connections == 0 and now - s.last_used > self.limits.idle_timeout_s:
                log.info("session %s expired", sid)
                del self.sessions[sid]

    async def compute(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run model work off the event loop: in the compute lane (FIFO), or beside other work (batching)."""
        def run() -> Any:
            if self.batcher is None:
                with self.lane, self._occupied():
                    return fn(*args)
            self.batcher.begin()
            try:
                with self._occupied():
                    return fn(*args)
            finally:
                self.batcher.end()

        return await asyncio.get_running_loop().run_in_executor(self.executor, run)

    @contextlib.contextmanager
    def _occupied(self) -> Any:
        """Count wall time with at least one computation in flight (metrics busy_seconds)."""
        with self._busy:
            if self._in_flight == 0:
                self._busy_since = time.perf_counter()
            self._in_flight += 1
        try:
            yield
        finally:
            with self._busy:
                self._in_flight -= 1
                if self._in_flight == 0:
                    self.model.metrics.busy_seconds += time.perf_counter() - self._busy_since

    @property
    def queue(self) -> int:
        """Computations running or waiting."""
        return self.lane.depth if self.batcher is None else self.batcher.depth

    # ---- HTTP ----------------------------------------------------------------------------------------------
    def process_request(self, ws: ServerConnection, request: Request) -> Response | None:
        """Serve /healthz and /metrics; refuse a websocket handshake with a wrong bearer token (HTTP 401)."""
        path = request.path.split("?")[0]
        if path == "/healthz":
            return self._http(ws, HTTPStatus.OK, json.dumps(self.health()) + "\n", "application/json")
        if path == "/metrics":
            return self._http(ws, HTTPStatus.OK, self.metrics_text(), "text/plain; version=0.0.4; charset=utf-8")
        header = request.headers.get("Authorization")
        ws.moa_owner = self.credentials.owner(bearer(header)) if header else None
        if header and ws.moa_owner is None:
            self.model.metrics.count(self.model.metrics.errors, P.E_AUTH)
            response = ws.respond(HTTPStatus.UNAUTHORIZED, "invalid bearer token\n")
            response.headers["WWW-Authenticate"] = 'Bearer realm="moa-server"'
            return response
        return None

    @staticmethod
    def _http(ws: ServerConnection, status: HTTPStatus, body: str, content_type: str) -> Response:
        response = ws.respond(status, body)
        del response.headers["Content-Type"]
        response.headers["Content-Type"] = content_type
        return response

    def health(self) -> dict[str, Any]:
        return {"status": "ok", "target": self.model.target.label, "fingerprint": self.model.fingerprint,
                "sessions": len(self.sessions), "connections": self.connections, "queue": self.queue,
                "batching": self.batcher is not None}

    def metrics_text(self) -> str:
        m = self.model.metrics
        lines: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: dict[str, float] | float, label: str = "") -> None:
            lines.extend([f"# HELP moa_{name} {help_}", f"# TYPE moa_{name} {kind}"])
            items = samples.items() if isinstance(samples, dict) else [("", samples)]
            lines.extend(f'moa_{name}{{{label}="{k}"}} {v}' if label else f"moa_{name} {v}" for k, v in items)

        def histogram(name: str, help_: str, h) -> None:
            lines.extend([f"# HELP moa_{name} {help_}", f"# TYPE moa_{name} histogram"])
            lines.extend(f'moa_{name}_bucket{{le="{b:g}"}} {c}' for b, c in zip(h.bounds, h.counts))
            lines.extend([f'moa_{name}_bucket{{le="+Inf"}} {h.count}', f"moa_{name}_sum {h.sum}",
                          f"moa_{name}_count {h.count}"])

        metric("sessions", "gauge", "Sessions held (with or without a connection).", len(self.sessions))
        metric("connections", "gauge", "Open websocket connections.", self.connections)
        metric("compute_queue", "gauge", "Computations running or waiting for the compute lane.", self.queue)
        metric("requests_total", "counter", "Requests by message type.", m.requests, "type")
        metric("errors_total", "counter", "Error replies and refused handshakes by code.", m.errors, "code")
        metric("accepted_tokens_total", "counter", "Draft tokens accepted by verify.", m.accepted_tokens)
        metric("committed_tokens_total", "counter", "Tokens added to session transcripts.", m.committed_tokens)
        metric("target_seconds_total", "counter", "Seconds of model compute (target and memory head), "
               "summed over requests: batched ones each count the forwards they shared (busy_seconds: the wall time).",
               m.target_seconds)
        metric("bytes_in_total", "counter", "Websocket payload bytes received.", m.bytes_in)
        metric("bytes_out_total", "counter", "Websocket payload bytes sent.", m.bytes_out)
        with self._busy:
            busy = m.busy_seconds + (time.perf_counter() - self._busy_since if self._in_flight else 0.0)
        metric("busy_seconds_total", "counter", "Wall seconds with at least one computation in flight.", busy)
        metric("target_forwards_total", "counter", "Target forwards run (a batched one serves several sessions).",
               self.model.target.forwards)
        # speculation (vLLM's spec_decode_* names)
        metric("spec_decode_num_drafts_total", "counter", "Draft trees verified.", m.drafts)
        metric("spec_decode_num_draft_tokens_total", "counter", "Draft tree nodes verified.", m.draft_tokens)
        metric("spec_decode_num_accepted_tokens_total", "counter", "Draft tokens accepted.", m.accepted_tokens)
        metric("spec_decode_num_accepted_tokens_per_pos_total", "counter", "Accepted draft tokens by position on the "
               "accepted path (0 = the first token after the root).", dict(sorted(m.accepted_per_position.items())),
               "position")
        histogram("spec_decode_acceptance_length", "Tokens gained per verify (the accepted path + the target's next "
                  "token): tau.", m.acceptance_length)
        metric("batching_enabled", "gauge", "1 when forwards of concurrent sessions are batched, 0 for FIFO.",
               int(self.batcher is not None))
        if self.batcher is not None:
            b = self.batcher.stats
            histogram("batch_size", "Sessions per batched target forward.", b.batch_size)
            histogram("batch_tokens", "New tokens per batched target forward.", b.batch_tokens)
            histogram("batch_queue_seconds", "Time a forward request waited for its batch.", b.queue_s)
            histogram("batch_forward_seconds", "Duration of a batched target forward.", b.forward_s)
            metric("batch_split_total", "counter", "Batches that failed and were run request by request.",
                   b.split_batches)
        return "\n".join(lines) + "\n"

    # ---- websocket -----------------------------------------------------------------------------------------
    async def handle(self, ws: ServerConnection) -> None:
        conn = Connection(ws, getattr(ws, "moa_owner", None))
        self.connections += 1
        watchdog = asyncio.get_running_loop().call_later(self.limits.hello_timeout_s, self._no_hello, conn)
        try:
            async for frame in ws:
                self.model.metrics.bytes_in += len(frame)
                await self.dispatch(conn, frame)
        except ConnectionClosed:
            pass
        finally:
            watchdog.cancel()
            self.connections -= 1
            self._detach(conn)

    def _no_hello(self, conn: Connection) -> None:
        if conn.session_id is None:
            log.info("closing a connection that sent no hello within %g s", self.limits.hello_timeout_s)
            asyncio.ensure_future(conn.ws.close(CLOSE_POLICY, "no hello in time"))

    def _detach(self, conn: Connection) -> None:
        """A connection ended: its sessions wait for a resume until the idle timeout; unused ones go now."""
        for sid in conn.attached:
            s = self.sessions.get(sid)
            if s is not None:
                s.connections -= 1
                s.last_used = time.monotonic()
                if s.connections == 0 and not s.used:
                    del self.sessions[sid]

    async def send(self, conn: Connection, frame: bytes) -> None:
        self.model.metrics.bytes_out += len(frame)
        await conn.ws.send(frame)

    async def dispatch(self, conn: Connection, frame: bytes | str) -> None:
        msg: P.Message | None = None
        try:
            msg = P.decode(frame)
            if msg.type not in P.CLIENT_TYPES:
                raise P.UnknownType(f"{msg.type!r} is a server -> client message")
            P.validate(msg)
            self.model.metrics.count(self.model.metrics.requests, msg.type)
            if conn.session_id is None and msg.type not in (P.HELLO, P.PING):
                raise P.BadRequest(f"{msg.type} before hello: send hello first")
            await self.handlers[msg.type](conn, msg)
        except P.ProtocolError as e:
            await self._error(conn, e.code, str(e), msg, retry=e.code in (P.E_BUSY, P.E_INTERNAL))
            if e.code in FATAL:
                await conn.ws.close(CLOSE_POLICY, e.code)
        except ConnectionClosed:
            raise
        except Exception as e:  # a server bug or a failing device: report it, keep serving
            log.exception("internal error on %s", msg.type if msg else "frame")
            await self._error(conn, P.E_INTERNAL, f"internal server error: {type(e).__name__}: {e}", msg)

    async def _error(self, conn: Connection, code: str, text: str, msg: P.Message | None, retry: bool = False) -> None:
        self.model.metrics.count(self.model.metrics.errors, code)
        seq = msg.fields.get("seq") if msg is not None else None
        await self.send(conn, P.error_frame(code, text, seq if type(seq) is int else None, retry))

    def session(self, conn: Connection, session_id: str | None) -> Session:
        """The session a request names (default: the connection's), checked against the caller's credentials."""
        sid = session_id or conn.session_id
        s = self.sessions.get(sid)
        if s is None:
            raise P.ProtocolError(f"session {sid} does not exist (expired or server restarted): prefill the whole "
                                  "transcript in the session from this connection's welcome", P.E_UNKNOWN_SESSION)
        if s.owner != conn.owner:
            raise P.ProtocolError(f"session {sid} belongs to other credentials", P.E_FOREIGN_SESSION)
        if sid not in conn.attached:
            conn.attached.add(sid)
            s.connections += 1
        s.last_used = time.monotonic()
        return s

    async def session_op(self, s: Session, fn: Callable[..., bytes], *args: Any) -> bytes:
        """Run a session operation, one per session at a time; one that fails half-way is undone (the session
        stays) and answered `internal` with retry true."""
        async with s.lock:
            try:
                return await self.compute(fn, *args)
            except P.ProtocolError:
                raise
            except Exception as e:
                log.exception("internal error in session %s", s.id)
                await self.compute(s.recover)
                raise P.ProtocolError(f"internal server error: {type(e).__name__}: {e} (the session is as it was "
                                      "before this request)", P.E_INTERNAL) from None

    def tokens(self, msg: P.Message) -> list[int]:
        tokens = msg.tensors["tokens"]
        if len(tokens) == 0:
            raise P.BadRequest(f"{msg.type}: tokens is empty")
        P.check_vocab(tokens, self.model.vocab_size)
        return tokens.tolist()

    # ---- messages ------------------------------------------------------------------------------------------
    async def on_hello(self, conn: Connection, msg: P.Message) -> None:
        f = msg.fields
        if conn.session_id is not None:
            raise P.BadRequest("hello was already sent on this connection")
        owner = conn.owner or self.credentials.owner(f.get("auth"))
        if owner is None:
            raise P.ProtocolError("missing or invalid credentials: send 'Authorization: Bearer <token>' in the "
                                  "websocket handshake or hello.auth", P.E_AUTH)
        diff = P.fingerprint_diff(self.model.fingerprint, f["fingerprint"])
        if diff:
            raise P.ProtocolError(f"the edge bundle does not fit this server: {', '.join(diff)} differ (server "
                                  f"{self.model.fingerprint}, edge {f['fingerprint']}); export the bundle from the "
                                  "server's target and drafter", P.E_FINGERPRINT)
        if len(self.sessions) >= self.limits.max_sessions or self._held(owner) >= self.limits.max_sessions_per_token:
            self.reap()
        if len(self.sessions) >= self.limits.max_sessions:
            raise P.ProtocolError(f"all {self.limits.max_sessions} sessions are in use, retry later", P.E_BUSY)
        if self._held(owner) >= self.limits.max_sessions_per_token:
            raise P.ProtocolError(f"these credentials hold {self.limits.max_sessions_per_token} sessions, the most "
                                  "allowed: close one or retry once idle ones expire", P.E_BUSY)
        s = Session(secrets.token_urlsafe(16), owner, f["row_dtype"], self.model)
        self.sessions[s.id] = s
        conn.owner, conn.session_id = owner, s.id
        self.session(conn, s.id)
        log.info("session %s opened by %s (%s)", s.id, owner, f["client"])
        await self.send(conn, P.encode(P.WELCOME, {
            "session_id": s.id, "limits": self.limits.public(), "target": self.model.target.label,
            "fingerprint": self.model.fingerprint, "vocab_size": self.model.vocab_size,
            "row_width": self.model.row_width, "row_dtype": s.row_dtype,
            "costs": self.model.costs.to_wire() if self.model.costs else None}))

    def _held(self, owner: str) -> int:
        """Sessions held by these credentials (on an open server every client is one owner: no quota)."""
        return 0 if self.credentials.open else sum(s.owner == owner for s in self.sessions.values())

    async def on_prefill(self, conn: Connection, msg: P.Message) -> None:
        s = self.session(conn, msg.fields.get("session_id"))
        args = (msg.fields["seq"], self.tokens(msg), sampling_of(msg.fields), self.pause)
        await self.send(conn, await self.session_op(s, s.prefill, *args))

    async def on_verify(self, conn: Connection, msg: P.Message) -> None:
        s = self.session(conn, msg.fields["session_id"])
        sampling = sampling_of(msg.fields)
        root, tree = P.decode_tree(msg.tensors, self.model.vocab_size, self.limits.max_tree_tokens,
                                   need_q=not sampling.greedy)
        await self.send(conn, await self.session_op(s, s.verify, msg.fields["seq"], root, tree, sampling))

    async def on_resume(self, conn: Connection, msg: P.Message) -> None:
        f = msg.fields
        s = self.session(conn, f["session_id"])
        if f["length"] < 0:
            raise P.BadRequest(f"resume: length {f['length']} is negative")
        args = (f["length"], self.tokens(msg), f["policy"], sampling_of(f), self.pause)
        await self.send(conn, await self.session_op(s, s.resume, *args))

    async def on_generate(self, conn: Connection, msg: P.Message) -> None:
        f = msg.fields
        prompt, sampling = self.tokens(msg), sampling_of(f)
        if f["max_new_tokens"] < 1 or len(prompt) + f["max_new_tokens"] > self.limits.max_context:
            raise P.ProtocolError(f"prompt of {len(prompt)} + max_new_tokens {f['max_new_tokens']} must be in "
                                  f"[1, max_context={self.limits.max_context}]", P.E_LIMIT)
        if not 0 <= f.get("copy_tokens", 0) < self.limits.max_tree_tokens:
            raise P.ProtocolError(f"copy_tokens {f['copy_tokens']} must be in [0, max_tree_tokens="
                                  f"{self.limits.max_tree_tokens})", P.E_LIMIT)
        if f["drafter"] == "server":
            self.model.require_memory_head()
        named = self.continuable(conn, f.get("session_id")) if f["drafter"] == "none" else None
        loop, frames = asyncio.get_running_loop(), asyncio.Queue()
        gone = threading.Event()

        def emit(text: str, ids: list[int]) -> None:  # in the compute lane, after every round
            if gone.is_set():
                raise Cancelled()
            if ids:
                loop.call_soon_threadsafe(frames.put_nowait, P.encode(P.TOKEN, {"text": text, "tokens": ids}))
            self.pause()

        def run(s: Session | None) -> None:
            try:
                done = self.model.generate(prompt, f["max_new_tokens"], sampling, f["drafter"], f.get("seed"), emit,
                                           f.get("copy_tokens"), s.runner if s is not None else None)
                loop.call_soon_threadsafe(frames.put_nowait, done)
            finally:
                if s is not None:
                    s.recover()  # its cache back to its own transcript
                loop.call_soon_threadsafe(frames.put_nowait, None)

        async with named.lock if named is not None else contextlib.nullcontext():
            continued = named if named is not None and named.starts(prompt) else None
            job = asyncio.ensure_future(self.compute(run, continued))
            try:
                while (frame := await frames.get()) is not None:
                    await self.send(conn, frame)
            finally:
                gone.set()
                with contextlib.suppress(Cancelled):
                    await job

    def continuable(self, conn: Connection, session_id: str | None) -> Session | None:
        """The session a plain `generate` names, whose target cache it continues when the session's transcript
        starts the prompt (`Session.starts`): an edge that hands the rest of a reply to the server pays no prefill.
        None when it names none or one that is gone (the prompt is prefilled as usual); another owner's is an
        error, as for any session request."""
        return self.session(conn, session_id) if session_id and session_id in self.sessions else None

    async def on_close(self, conn: Connection, msg: P.Message) -> None:
        s = self.session(conn, msg.fields.get("session_id"))
        del self.sessions[s.id]
        if s.id == conn.session_id:  # this connection may say hello again for a new session
            conn.session_id = None
        log.info("session %s closed", s.id)

    async def on_ping(self, conn: Connection, msg: P.Message) -> None:
        await self.send(conn, P.encode(P.PONG, {"t": msg.fields.get("t")}))
