"""The edge client's I/O: the link, the reconnector and the drivers of the I/O-free `EdgeCore` (edge_client/core.py)
for speculative decoding against a verify server, offline continuation and resync (docs/design.md §6-7).

`EdgeSession` drafts trees with the bundle's ONNX drafter, has the server verify them (docs/protocol.md) and
streams the text as tokens are accepted. The edge's transcript (the core's) is the source of truth; the server's
is a cache.

- A dropped connection is reopened once at once and the unanswered request sent again with the same `seq` (the
  server answers a repeated `seq` with its cached reply, so a lost reply is simply retried).
- If that fails, or a reply times out, or the server says "retry later", the edge goes offline at once: it keeps
  generating with its drafter alone (memory rows frozen at the last verified token), streams those tokens marked
  `offline`, and reconnects in the background (exponential backoff with jitter). Offline tokens are chosen under
  an `OfflineGuard` (no repeated n-grams, no long newline runs, copying what the text repeats, optionally a
  repetition penalty) and at `offline_temperature`; verified tokens never are, so online output stays the
  target's.
- Back online it resumes by policy. `keep`: the server takes the offline tokens as they are. `verify`: the target
  checks them and the edge rewinds to the first disagreement; the stream then carries a `Chunk` whose `rewind`
  says how many characters of the text shown so far to delete before appending it. Under `verify` a generation
  that reaches its end on unverified tokens waits up to `resync_wait_s` for the server, then verifies and goes on;
  `Result.unverified` counts the tokens the target never checked.
- A server that lost the session (restart, expiry) gets the transcript again by prefill in a new session.

`AsyncEdgeSession` is the asyncio front: the same session with its blocking work in a worker thread.
"""

from __future__ import annotations

import asyncio
import logging
import random
import ssl
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from importlib.util import find_spec
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Generator, Iterator

import numpy as np
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, InvalidURI
from websockets.sync.client import ClientConnection, connect

from edge_client.bundle import BUNDLE_FILE, Bundle, BundleError, load_bundle
from edge_client.core import POLICIES, EdgeCore, EdgeError, Request, State, Stats, common_prefix, token_tensor
from edge_client.runtime import OrtDraftStep
from moa_core import protocol as P
from moa_core.budget import Choice, Costs, Forecast, Pacer, TreeTuner, agreement_table, measure_draft, prior_s
from moa_core.drafting import OfflineGuard
from moa_core.generation import Prompt, StopRule, encode_prompt
from moa_core.lookup import COPY_TOKENS
from moa_core.paths import cache_dir
from moa_core.tree import TreeConfig

log = logging.getLogger("moa.edge")

DEFAULT_SERVER = "ws://127.0.0.1:8765"
MODES = ("speculative", "api", "offline")
CLIENT_NAME = "moa-edge"


# ---- errors ---------------------------------------------------------------------------------------------------
class ServerError(EdgeError):
    """An `error` reply the client cannot recover from; `code` is the protocol's error code."""

    HINTS = {P.E_AUTH: "pass the server's token with --token or MOA_TOKEN",
             P.E_FINGERPRINT: "use a bundle exported from the server's target and drafter (--bundle)"}

    def __init__(self, code: str, message: str):
        hint = f" ({self.HINTS[code]})" if code in self.HINTS else ""
        super().__init__(f"server error {code}: {message}{hint}")
        self.code = code


class LinkDown(EdgeError):
    """The server cannot be used right now (connection lost or refused, timeout, busy): the edge goes offline."""

    def __init__(self, message: str, timed_out: bool = False):
        super().__init__(message)
        self.timed_out = timed_out


# ---- results --------------------------------------------------------------------------------------------------
class Chunk(str):
    """A piece of streamed text.

    `rewind` > 0: first delete that many characters of the text streamed so far (offline text the target rejected
    when resuming under the `verify` policy), then append this chunk. `offline`: made by the edge's drafter alone.
    """

    rewind: int
    offline: bool

    def __new__(cls, text: str, rewind: int = 0, offline: bool = False) -> "Chunk":
        chunk = super().__new__(cls, text)
        chunk.rewind, chunk.offline = rewind, offline
        return chunk


@dataclass
class Result:
    text: str
    token_ids: list[int]
    finish_reason: str  # "eos" | "length" (| "stop" from the server in api mode)
    unverified: int = 0  # tokens made by the edge drafter alone that the target never checked

    @property
    def verified(self) -> bool:
        return self.unverified == 0


# ---- the default bundle ---------------------------------------------------------------------------------------
def default_bundle(drafter: str = "moa", dtype: str = "fp32") -> Path:
    """The bundle of a shipped drafter (`moa`, the default, or `eagle`) in the cache, exported when missing or older
    than the drafter.

    The exporter runs in a subprocess (it needs torch; the edge never imports it)."""
    out = cache_dir() / "bundles" / (f"default-{drafter}" + ("" if dtype == "fp32" else f"-{dtype}"))
    spec = find_spec("models")  # locates the project's models package without importing it
    weights = Path(spec.origin).parent / "default" / drafter / "model.safetensors" if spec and spec.origin else None
    meta = out / BUNDLE_FILE
    if meta.exists() and not (weights and weights.exists() and weights.stat().st_mtime > meta.stat().st_mtime):
        return out
    log.warning("exporting the shipped %s drafter's edge bundle (%s) to %s (once, a few minutes on a CPU)",
                drafter, dtype, out)
    proc = subprocess.run([sys.executable, "-m", "export.to_onnx", "--drafter", drafter, "--dtype", dtype,
                           "--out", str(out)], capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise EdgeError(f"no edge bundle at {out} and exporting one failed (it needs the server and export extras); "
                        f"pass --bundle DIR. Exporter: {' | '.join(tail)}")
    return out


def fit_tree(tree: TreeConfig | str, bundle: Bundle, step: OrtDraftStep, link: Link,
             rtt: float) -> tuple[TreeConfig, str, TreeTuner | None]:
    """The draft tree budget, why, and the cost model's tuner (tree auto with the server's costs only).
    `auto`: the budget with the most predicted tokens/s from the drafter's held-out agreement, this edge's draft
    step time, the server's costs (welcome.costs) and the round trip `rtt` (moa_core/budget.py); without those,
    the budget the exporter measured the bundle's acceptance with.

    Either way the tree is cut to the server's max_tree_tokens (root included)."""
    tuner = None
    if tree == "auto":
        tree, why, tuner = auto_tree(bundle, step, link, rtt)
    else:
        tree, why = (tree if isinstance(tree, TreeConfig) else TreeConfig.parse(tree)), "given"
    max_tree_tokens = link.welcome["limits"]["max_tree_tokens"]
    if tree.total_tokens >= max_tree_tokens:
        tree, why = replace(tree, total_tokens=max_tree_tokens - 1), f"{why}; cut to the server's limit"
    return tree, why, tuner


def server_time(msg: P.Message) -> float:
    """The server's compute seconds that a reply reports (its `timings`)."""
    return sum(v for v in (msg.fields.get("timings") or {}).values() if isinstance(v, float))


def auto_tree(bundle: Bundle, step: OrtDraftStep, link: Link,
              rtt: float) -> tuple[TreeConfig, str, TreeTuner | None]:
    costs = link.costs
    if costs and bundle.agreement_topk:
        context = sum(costs.contexts) / 2
        draft_s = measure_draft(step, bundle.row_width, bundle.hidden_size)
        tuner = TreeTuner(agreement_table(bundle.agreement_topk), draft_s, costs.verify(context), rtt, costs.row_s,
                          costs.decode(context))
        choice = tuner.choice
        why = (f"auto: {choice.describe()} (server verify round of 1 token {costs.verify(context)[1] * 1e3:.0f} ms, "
               f"decode step {costs.decode(context) * 1e3:.0f} ms, edge draft step {draft_s[1] * 1e3:.1f} ms, "
               f"round trip {rtt * 1e3:.1f} ms)")
        if not choice.pays:
            why += "; predicted slower than the server alone: the server generates (api) until speculation pays"
        return choice.tree, why, tuner
    acc = bundle.meta.get("checks", {}).get("acceptance")
    if acc:
        return TreeConfig.parse(acc["tree"]), f"auto: measured at export, tau {acc['tau_ort']:.2f}", None
    return TreeConfig(), "auto: default budget, the bundle has no acceptance record", None


# ---- the connection -------------------------------------------------------------------------------------------
class Link:
    """One websocket connection after a successful hello; raw frames in and out."""

    def __init__(self, ws: ClientConnection, timeout_s: float):
        self.ws, self.timeout_s = ws, timeout_s
        self.welcome: dict[str, Any] = {}
        self.costs: Costs | None = None  # what the server measured its rounds to cost (welcome.costs)

    @classmethod
    def open(cls, url: str, token: str | None, fingerprint: str, row_dtype: str, timeout_s: float,
             ssl_context: ssl.SSLContext | None = None) -> "Link":
        """Connect and say hello. Raises ServerError (auth, fingerprint: fatal) or LinkDown (try again later).
        `ssl_context` (wss:// only): e.g. one that trusts a private CA."""
        headers = {"Authorization": f"Bearer {token}"} if token else None
        try:
            ws = connect(url, additional_headers=headers, open_timeout=timeout_s, close_timeout=1, max_size=None,
                         compression=None, legacy=True, ssl=ssl_context if url.startswith("wss://") else None)
        except InvalidURI:
            raise EdgeError(f"bad server URL {url!r}: expected ws://HOST:PORT or wss://HOST:PORT") from None
        except InvalidStatus as e:
            if e.response.status_code == 401:
                raise ServerError(P.E_AUTH, "the server rejected the token (HTTP 401)") from None
            raise LinkDown(f"{url} refused the connection (HTTP {e.response.status_code})") from None
        except (OSError, TimeoutError, InvalidHandshake, ConnectionClosed) as e:  # closed: reset in the handshake
            raise LinkDown(f"cannot reach {url}: {e}") from None
        link = cls(ws, timeout_s)
        try:
            link.send(P.encode(P.HELLO, {"fingerprint": fingerprint, "client": CLIENT_NAME, "row_dtype": row_dtype}))
            link.welcome = expect(decode_reply(link.recv()), P.WELCOME).fields
            link.costs = Costs.from_wire(link.welcome["costs"]) if link.welcome.get("costs") else None
        except EdgeError:
            link.close()
            raise
        return link

    @property
    def session_id(self) -> str:
        return self.welcome["session_id"]

    def round_trip_s(self, n: int = 3) -> float:
        """Median seconds of n ping/pong exchanges."""
        times = []
        for _ in range(n):
            t = time.perf_counter()
            self.send(P.encode(P.PING, {"t": t}))
            expect(decode_reply(self.recv()), P.PONG)
            times.append(time.perf_counter() - t)
        return float(np.median(times))

    def send(self, frame: bytes) -> None:
        try:
            self.ws.send(frame)
        except (ConnectionClosed, OSError) as e:
            raise LinkDown(f"connection lost ({e})") from None

    def recv(self) -> bytes:
        try:
            return self.ws.recv(self.timeout_s)
        except TimeoutError:
            raise LinkDown(f"no reply within {self.timeout_s:g} s", timed_out=True) from None
        except (ConnectionClosed, OSError) as e:
            raise LinkDown(f"connection lost ({e})") from None

    def close(self) -> None:
        self.ws.close()


def decode_reply(data: bytes) -> P.Message:
    """A server frame; an `error` raises LinkDown when the server says retry later, else ServerError."""
    try:
        msg = P.decode(data)
        P.validate(msg)
    except P.ProtocolError as e:
        raise EdgeError(f"unreadable reply from the server: {e}") from None
    if msg.type == P.ERROR:
        f = msg.fields
        if f["retry"]:
            raise LinkDown(f"server busy ({f['code']}): {f['message']}")
        raise ServerError(f["code"], f["message"])
    return msg


def expect(msg: P.Message, msg_type: str) -> P.Message:
    if msg.type != msg_type:
        raise EdgeError(f"expected a {msg_type} reply, the server sent {msg.type}")
    return msg


class Reconnector:
    """Opens a link in a background thread: first after `delay_s`, then with exponential backoff and jitter."""

    def __init__(self, open_link: Callable[[], Link], delay_s: float, backoff_s: tuple[float, float]):
        self._open, self._backoff = open_link, backoff_s
        self._stop, self._done = threading.Event(), threading.Event()
        self.link: Link | None = None
        self.error: EdgeError | None = None
        self.attempts = 0
        threading.Thread(target=self._run, args=(delay_s,), daemon=True, name="moa-reconnect").start()

    def _run(self, wait: float) -> None:
        step, cap = self._backoff
        while not self._stop.wait(wait):
            self.attempts += 1
            try:
                self.link = self._open()
            except LinkDown as e:
                log.debug("reconnect attempt %d: %s", self.attempts, e)
                wait, step = step * random.uniform(0.5, 1.0), min(cap, step * 2)
                continue
            except EdgeError as e:  # auth, fingerprint: trying again will not help
                self.error = e
            except Exception as e:  # a bug: report it to the session instead of ending the thread silently
                self.error = EdgeError(f"reconnecting failed: {type(e).__name__}: {e}")
            break
        if self._stop.is_set() and self.link is not None:
            self.link.close()
        self._done.set()

    def wait(self, timeout: float) -> bool:
        """Block until the attempts have ended (connected or failed for good) or `timeout` seconds pass."""
        return self._done.wait(timeout)

    def take(self, timeout: float = 0.0) -> Link | None:
        """The new link once connected, else None; a fatal connection error is raised here."""
        if not self.wait(timeout):
            return None
        if self.error is not None:
            raise self.error
        return self.link

    def stop(self) -> None:
        self._stop.set()
        if self._done.is_set() and self.link is not None:
            self.link.close()


# ---- the session ----------------------------------------------------------------------------------------------
class EdgeSession:
    """A conversation with one verify server (or none, in offline mode), one generation at a time.

        with EdgeSession(bundle, "ws://gpu-box:8765", token="...") as s:
            for chunk in s.generate("Why is the sky blue?", max_new_tokens=64):
                print(chunk, end="", flush=True)
            print(s.result.text, s.stats.tau)

    Modes: `speculative` (draft on the edge, verify on the server), `api` (the server generates and streams: the
    baseline), `offline` (never connects; the drafter alone, without target memory). The constructor connects
    and fails with a clear error on a wrong token, a bundle that does not fit the server, or no server at all.
    `copy_tokens` > 0 (0 = off): trees also verify up to that many tokens copied from where the transcript's
    last tokens occurred before (prompt lookup's proposal, grafted onto the drafted tree; sampling tries it first,
    as a one-hot proposal, and stays lossless); when the server generates alone (api mode, or the Pacer's switch)
    it verifies such copies itself. `handover` (tree auto): when speculation stops paying in the middle of a reply,
    the server generates the rest of it alone, continuing the session's target cache (no prefill again).
    """

    def __init__(self, bundle: str | Path | Bundle | None = None, server: str = DEFAULT_SERVER,
                 token: str | None = None, mode: str = "speculative", tree: TreeConfig | str = "auto",
                 on_reconnect: str = "keep", row_dtype: str = "fp16", timeout_s: float = 15.0,
                 backoff_s: tuple[float, float] = (0.25, 8.0), providers: str = "auto", threads: int | None = None,
                 resync_wait_s: float = 30.0, cafile: str | None = None,
                 offline_guard: OfflineGuard | None = OfflineGuard(), offline_temperature: float | None = None,
                 copy_tokens: int = COPY_TOKENS, handover: bool = True):
        if copy_tokens < 0:
            raise ValueError(f"copy_tokens must be >= 0, got {copy_tokens}")
        for name, value, allowed in (("mode", mode, MODES), ("on_reconnect", on_reconnect, POLICIES),
                                     ("row_dtype", row_dtype, P.ROW_DTYPES)):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
        self.bundle = bundle if isinstance(bundle, Bundle) else load_bundle(bundle or default_bundle())
        self.fingerprint: str = self.bundle.meta.get("fingerprint") or ""
        if not self.fingerprint:
            raise BundleError(f"{self.bundle.path}: bundle.json has no server fingerprint (exported by an older "
                              "exporter): export it again")
        self.tokenizer = self.bundle.chat_tokenizer()
        self.step = OrtDraftStep(self.bundle, providers, threads)
        self.server, self.token, self.mode, self.policy = server, token, mode, on_reconnect
        self.row_dtype, self.timeout_s, self.backoff_s = row_dtype, timeout_s, backoff_s
        self.resync_wait_s = resync_wait_s  # under `verify`: how long a generation waits to verify its offline end
        self.ssl_context = ssl.create_default_context(cafile=cafile) if cafile else None
        # offline tokens: the guard (None: plain drafter output) and temperature (None: the generation's)
        self.offline_guard = offline_guard.for_vocabulary(self.tokenizer.token_texts(),
                                                        self.tokenizer.special_token_ids()) if offline_guard else None
        self.offline_temperature = offline_temperature
        self.copy_tokens, self.handover = copy_tokens, handover
        self.tree, self.tree_note = TreeConfig(), f"unused in {mode} mode"
        self.tuner: TreeTuner | None = None  # tree auto: chooses the tree again between generations
        # what generations will take, per mode they run in: the cost model, then what was observed
        self.forecasts = {m: Forecast(lambda p, n, m=m: self.prior_s(m, p, n)) for m in ("api", "speculative")}
        self.pacer: Pacer | None = None  # speculative mode with tree auto: whether to let the server generate
        self.rtt_s = 0.0
        self.stats = Stats(mode)
        self.result: Result | None = None
        self.target: str | None = None  # the server's target model, once connected
        self._link: Link | None = None
        self._reconnector: Reconnector | None = None
        self._shown = ""  # the text streamed so far in this generation
        self.core = EdgeCore(self.step, self.bundle.row_width, self.tree, on_reconnect)  # the transcript
        if mode != "offline":
            self._link = self._open()
            self.core.session_id, self.target = self._link.session_id, self._link.welcome["target"]
            self.rtt_s = self._link.round_trip_s()
            if mode == "speculative":  # api mode never drafts: no budget to fit
                tree, self.tree_note, self.tuner = fit_tree(tree, self.bundle, self.step, self._link, self.rtt_s)
                self._use_tree(tree)
                # a switch to the server alone lasts the rest of a reply or whole ones: probe speculation again rarely
                self.pacer = Pacer(self.choice, probe_after=512) if self.choice else None
                self._paid = self.pacer.pays if self.pacer else True  # the verdict last reported
                log.info("connected to %s: target %s, session %s, tree %s (%s)", server, self.target,
                         self.session_id, self.tree, self.tree_note)
            else:
                log.info("connected to %s: target %s, session %s", server, self.target, self.session_id)

    # ---- public API -------------------------------------------------------------------------------------------
    @property
    def online(self) -> bool:
        return self._link is not None

    @property
    def choice(self) -> Choice | None:
        """The cost model's prediction for the current tree (tree auto with the server's costs)."""
        return self.tuner.choice if self.tuner is not None else None

    @property
    def session_id(self) -> str | None:
        """The server session that holds the committed transcript."""
        return self.core.session_id

    @property
    def prompt(self) -> list[int]:
        return self.core.prompt

    @property
    def tokens(self) -> list[int]:
        """The transcript: tokens[:length] committed on the server, then the pending root and any offline tokens."""
        return self.core.tokens

    @property
    def length(self) -> int:
        return self.core.length

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt: text is one user turn, dicts are chat messages (chat template), ints pass as is."""
        return encode_prompt(prompt, self.tokenizer.encode_chat)

    def generate(self, prompt: Prompt, max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int = 0, seed: int | None = None, drop_after: int | None = None,
                 offline_for: float | None = None, handover_after: int | None = None) -> Iterator[Chunk]:
        """Stream the reply to `prompt` as text chunks; `result` and `stats` hold the outcome once it ends.

        Stops after the first EOS (kept) or `max_new_tokens`. `temperature` 0 is greedy. For experiments,
        `drop_after` drops the link once that many generated tokens are verified and keeps it down for
        `offline_for` seconds (None: to the end of this generation); `handover_after` hands the rest of the reply
        to the server once that many are verified, whatever the Pacer says."""
        ids = self.encode(prompt)
        mode = self._next_mode()  # api when speculation does not pay: the server generates this reply alone
        if self.pacer is not None and self.online:
            self._say_pace()
        forecast = self.forecasts.get(mode) if self.online else None
        predicted = forecast.copy() if forecast else None  # what was predicted before this generation
        self.stats = Stats(mode, tree=str(self.tree) if mode == "speculative" else "")
        self.result = None
        self._sampling = {"temperature": float(temperature), "top_p": float(top_p), "top_k": int(top_k)}
        self._rng = np.random.default_rng(seed)
        start = time.perf_counter()
        first_s = None  # time to the first chunk: the prefill, for the forecast
        run = self._api(ids, max_new_tokens) if mode == "api" else \
            self._speculative(ids, max_new_tokens, drop_after, offline_for, handover_after)
        for chunk in run:
            self.stats.total_s = time.perf_counter() - start
            first_s = first_s or self.stats.total_s
            yield chunk
        self.stats.total_s = time.perf_counter() - start
        self.stats.new_tokens = n = len(self.result.token_ids)
        if forecast is not None and not self.stats.offline_tokens:  # offline stretches are not what it predicts
            self.stats.predicted_s = predicted.seconds(len(ids), n)
            first_s = first_s or self.stats.total_s
            forecast.observe(len(ids), first_s, n, self.stats.total_s - first_s)

    def prior_s(self, mode: str, prompt_tokens: int, new_tokens: int) -> tuple[float, float] | None:
        """What the cost model, from what was measured at connect, predicts a generation in `mode` costs
        (moa_core.budget's `prior_s`, a round trip before the first token). None without the server's costs."""
        costs = self._link.costs if self._link is not None else None
        if costs is None:
            return None
        return prior_s(costs, self.choice, prompt_tokens, new_tokens, plain=mode == "api", link_s=self.rtt_s)

    def _use_tree(self, tree: TreeConfig) -> None:
        self.tree = self.core.tree = tree
        # a copy chain grafted onto the tree keeps the verify within the server's limit
        room = self._link.welcome["limits"]["max_tree_tokens"] - 1 - tree.total_tokens
        self.core.copy_tokens = max(0, min(self.copy_tokens, room))

    def _next_mode(self) -> str:
        """The mode the next generation runs in: api while speculation does not pay, judged for a new prompt by the
        drafter's long-run acceptance, not by the last reply's final rounds (`Pacer.restart`), with the tree chosen
        again from the tokens the rounds gained so far (`TreeTuner`)."""
        if self.pacer is not None and self.online:
            if note := self.tuner.retune(self.pacer):
                log.info(note)
                self._use_tree(self.choice.tree)
            self.pacer.restart()
            if not self.pacer.speculate():
                return "api"
        return self.mode

    def predict_s(self, prompt_tokens: int, new_tokens: int) -> float | None:
        """Seconds the next generation is predicted to take in the mode it will run in (`forecasts`: the cost
        model, refreshed by the generations observed since). None offline or without anything to predict with."""
        forecast = self.forecasts.get(self._next_mode())
        return forecast.seconds(prompt_tokens, new_tokens) if forecast and self.online else None

    def _say_pace(self) -> None:
        """Log the pacer's verdict when it has changed since it was last said."""
        if self.pacer.pays != self._paid:
            self._paid = self.pacer.pays
            spec, api = self.pacer.rates()
            log.info("speculation %s (observed %.1f tokens/s vs %.1f from the server alone, the server's time at its "
                     "measured speed): %s", "pays again" if
                     self._paid else "does not pay", spec, api, "speculating" if self._paid else
                     "the server generates alone (api), trying speculation again after "
                     f"{self.pacer.probe_after} tokens")

    def complete(self, prompt: Prompt, **kwargs: Any) -> Result:
        """generate() to the end; the Result."""
        for _ in self.generate(prompt, **kwargs):
            pass
        return self.result

    def wait_for_link(self, timeout: float) -> bool:
        """Block until the background reconnect has a connection (True) or `timeout` seconds pass (False).

        For apps that would rather wait than generate offline; the link is taken up at the next step."""
        return self._link is not None or (self._reconnector is not None and
                                          self._reconnector.take(timeout) is not None)

    def close(self) -> None:
        """Tell the server to drop the session and close the connection."""
        if self._reconnector is not None:
            self._reconnector.stop()
        if self._link is not None:
            try:
                self._link.send(P.encode(P.CLOSE, {"session_id": self.session_id}))
            except LinkDown:
                pass
            self._link.close()
            self._link = None

    def __enter__(self) -> "EdgeSession":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- requests ---------------------------------------------------------------------------------------------
    def _open(self) -> Link:
        return Link.open(self.server, self.token, self.fingerprint, self.row_dtype, self.timeout_s, self.ssl_context)

    def _send(self, frame: bytes) -> None:
        self._link.send(frame)
        self.stats.server_calls += 1
        self.stats.bytes_up += len(frame)

    def _receive(self) -> P.Message:
        t = time.perf_counter()
        try:
            data = self._link.recv()
        finally:
            self.stats.network_wait_s += time.perf_counter() - t
        self.stats.bytes_down += len(data)
        msg = decode_reply(data)
        self.stats.server_s += server_time(msg)
        return msg

    def _request(self, request: Request) -> P.Message:
        """One request and its reply. A dropped connection is reopened once and the very same frame (same seq)
        sent again. Raises LinkDown (go offline) or ServerError."""
        try:
            self._send(request.frame)
            return self._receive()
        except LinkDown as e:
            if e.timed_out:
                raise
            self._link.close()
            try:
                self._link = self._open()
            except ServerError as reopen:  # e.g. back with another model: offline, the reconnect attempts report it
                raise LinkDown(str(reopen)) from None
            self.stats.retries += 1
            self._send(request.frame)
            return self._receive()

    # ---- speculative and offline generation -------------------------------------------------------------------
    def _speculative(self, prompt: list[int], max_new: int, drop_after: int | None,
                     offline_for: float | None, handover_after: int | None) -> Iterator[Chunk]:
        core = self.core
        self._start(prompt, max_new)
        deadline = None  # for the wait to verify an offline end, from when the end is first reached
        while True:
            yield from self._emit(max_new)
            if self.result is not None:
                self.result.unverified = core.unverified(len(self.result.token_ids))
                deadline = deadline or time.monotonic() + self.resync_wait_s
                if not self._resync_before_end(deadline):
                    return
                self.result = None
            if core.state is State.OFFLINE:
                self._adopt_link()
            if core.state is State.OFFLINE:
                self._offline_step()
            elif drop_after is not None and core.length - len(prompt) >= drop_after:
                drop_after = None
                self._go_offline(f"link dropped on purpose after {core.length - len(prompt)} verified tokens",
                                 offline_for)
            elif handover_after is not None and core.length - len(prompt) >= handover_after:
                yield from self._hand_over(max_new, "as asked")
            elif self._losing():
                yield from self._hand_over(max_new, "speculation does not pay in it")
            else:
                self._verify_round()

    def _start(self, prompt: list[int], max_new: int) -> None:
        """A new generation: keep what the server has committed of this prompt, connect, sync."""
        self.core.start(prompt, self._sampling, self.stats)
        self._shown = ""
        if self.mode == "offline":
            return
        if self._link is None:  # down since an earlier generation: one attempt now, else start offline
            if self._reconnector is not None:
                self._reconnector.stop()
                self._reconnector = None
            try:
                self._link = self._open()
            except LinkDown as e:
                self._go_offline(str(e))
                return
        limit = self._link.welcome["limits"]["max_context"]
        if len(prompt) + max_new + self.tree.total_tokens + 1 > limit:
            raise EdgeError(f"prompt ({len(prompt)} tokens) + max_new_tokens ({max_new}) + tree "
                            f"({self.tree.total_tokens}) is over the server's max_context ({limit})")
        self._sync()

    def _sync(self, lost: bool = False) -> None:
        """Bring the server up to the edge's transcript (EdgeCore.sync_request); a server that lost the session
        gets the transcript again by prefill. If the link fails meanwhile, go offline."""
        core = self.core
        try:
            core.begin_sync(self._link.session_id, lost)
            while core.state is State.RESYNCING:
                request = core.sync_request()
                try:
                    reply = self._request(request)
                except ServerError as e:
                    if e.code != P.E_UNKNOWN_SESSION or request.type != P.RESUME or core.prefilled:
                        raise
                    core.begin_sync(self._link.session_id, lost=True)
                    continue
                core.on_reply(reply)
        except LinkDown as e:
            self._go_offline(str(e))

    def _verify_round(self) -> None:
        t = time.perf_counter()
        request = self.core.verify_request(self._rng)
        self.stats.draft_s += time.perf_counter() - t
        try:
            reply = self._request(request)
        except LinkDown as e:
            self._go_offline(str(e))
            return
        except ServerError as e:
            if e.code != P.E_UNKNOWN_SESSION:
                raise
            self._sync(lost=True)
            return
        new = self.core.on_reply(reply)
        costs = self._link.costs if self.pacer is not None else None
        if costs is not None:  # the server's time counts at what it measured at start: its load comes and goes
            predicted = costs.round_target_s(self.length, 1 + len(request.tree.tokens), len(new))
            self.pacer.observe(True, len(new), time.perf_counter() - t, server_time(reply), predicted)
            if request.tree.sources is None:  # the drafter's tree alone: what the tuner predicts
                self.tuner.observe(self.tree, len(new))

    def _losing(self) -> bool:
        """Whether speculation has stopped paying in this reply (the Pacer's verdict after its rounds, with `handover`
        on; a reply that starts as a probe of speculation gets its round first)."""
        return self.handover and self.pacer is not None and not self.pacer.pays and self.stats.verify_calls > 0

    def _hand_over(self, max_new: int, why: str) -> Iterator[Chunk]:
        """The server generates the rest of this reply alone, from the committed transcript and the pending root,
        continuing the session's target cache. Its tokens join the transcript as they come (`EdgeCore.take_alone`),
        so a link lost meanwhile goes offline from the last of them, and a later sync resumes them."""
        core = self.core
        log.info("the server generates the rest of this reply alone, after %d tokens (%s)", len(core.generated), why)
        try:
            f = yield from self._server_generates(core.tokens, max_new - len(core.generated), core.session_id,
                                                  lambda ids, _text: self._take_alone(ids, max_new))
        except LinkDown as e:
            self._go_offline(str(e))
            return
        yield from self._take_alone(f["tokens"][core.alone:], max_new)  # a server that streams no token ids
        self.stats.server_s += f["stats"].get("total_s", 0.0)

    def _take_alone(self, ids: list[int], max_new: int) -> Iterator[Chunk]:
        if ids and self.result is None:
            vocab = self.bundle.meta["vocab_size"]
            if not all(0 <= i < vocab for i in ids):
                raise EdgeError(f"the server generated token ids outside the vocabulary [0, {vocab}): {ids}")
            self.core.take_alone(ids)
            yield from self._emit(max_new)

    def _go_offline(self, reason: str, reconnect_after: float | None = 0.0) -> None:
        """Generate locally from now on; reconnect in the background after `reconnect_after` s (None: never)."""
        log.warning("offline: %s; generating with the edge drafter alone", reason)
        self.core.go_offline()
        if self._link is not None:
            self._link.close()
            self._link = None
        if reconnect_after is not None:
            self._reconnector = Reconnector(self._open, reconnect_after, self.backoff_s)

    def _resync_before_end(self, deadline: float) -> bool:
        """Under `verify`, at the end of a generation with unverified tokens: wait until `deadline` for the
        background reconnect and resync (True: generation goes on from the rewound transcript)."""
        if self.policy != "verify" or self.result.verified or self._reconnector is None:
            return False
        wait = deadline - time.monotonic()
        log.info("waiting up to %.1f s for the server to verify %d offline tokens", max(0.0, wait),
                 self.result.unverified)
        if not self._reconnector.wait(max(0.0, wait)):
            log.warning("the server did not come back in time: %d tokens of the reply are unverified",
                        self.result.unverified)
            return False
        self._adopt_link()
        return self._link is not None or self._reconnector is not None  # None, None: it cannot come back

    def _adopt_link(self) -> None:
        """Take up the background reconnect's link, if there is one yet, and resync. A reconnect that cannot
        succeed (auth, another model on the server) ends the attempts: the generation finishes offline."""
        try:
            link = self._reconnector.take() if self._reconnector is not None else None
        except EdgeError as e:
            log.warning("cannot resync: %s; finishing offline, unverified", e)
            self._reconnector = None
            return
        if link is None:
            return
        log.info("back online after %d attempt(s)", self._reconnector.attempts)
        self._link, self._reconnector = link, None
        self.stats.reconnects += 1
        self._sync()

    def _offline_step(self) -> None:
        """One token from the drafter alone, memory frozen at the last verified token."""
        t = time.perf_counter()
        temperature = self._sampling["temperature"] if self.offline_temperature is None else self.offline_temperature
        self.core.offline_token(temperature, self._rng, self.offline_guard)
        self.stats.draft_s += time.perf_counter() - t

    def _emit(self, max_new: int) -> Iterator[Chunk]:
        """The text change since the last chunk; sets `result` once generation has ended."""
        out, reason = StopRule(self.tokenizer.eos_token_ids).cut(self.core.generated, max_new)
        done = reason is not None
        text = self.tokenizer.decode(out)
        if not done:
            text = text.rstrip("\ufffd")  # an incomplete UTF-8 sequence: wait for its next token
        keep = common_prefix(self._shown, text)
        if keep < len(self._shown) or keep < len(text):
            yield Chunk(text[keep:], rewind=len(self._shown) - keep, offline=self.core.state is State.OFFLINE)
            self._shown = text
        if done:
            self.result = Result(text, out, reason)

    # ---- the server alone: api mode, or a reply handed over --------------------------------------------------
    def _api(self, prompt: list[int], max_new: int) -> Iterator[Chunk]:
        """The server generates with the target alone and streams text (the baseline; no offline fallback), verifying
        copy chains where the text repeats (`copy_tokens`; 0: plain decoding)."""
        if self._link is None:
            self._link = self._open()
        f = yield from self._server_generates(prompt, max_new, None, _text_chunk)
        lengths = f["stats"].get("acceptance_lengths", [])
        self.stats.verify_calls, self.stats.accepted_tokens = len(lengths), sum(lengths)
        self.stats.copy_rounds = f["stats"].get("copy_rounds", 0)
        self.stats.server_s = f["stats"].get("total_s", 0.0)
        self.result = Result(f["text"], list(f["tokens"]), f["finish_reason"])

    def _server_generates(self, prompt: list[int], max_new: int, session_id: str | None,
                          on_tokens: Callable[..., Iterator[Chunk]]) -> Generator[Chunk, None, dict[str, Any]]:
        """`generate` on the server with the target alone (and copy chains); `on_tokens(ids, text)` makes the chunks
        of each streamed round. Feeds the Pacer the server's decoding rate; returns the `done` fields."""
        room = self._link.welcome["limits"]["max_tree_tokens"] - 1  # the server's bound on copy_tokens
        fields = {"max_new_tokens": max_new, **self._sampling, "drafter": "none",
                  "copy_tokens": min(self.copy_tokens, room), "session_id": session_id}
        self._send(P.encode(P.GENERATE, fields, token_tensor(prompt)))
        first = None  # when the first token came: the rate after it is the server's decoding, prefill excluded
        while (msg := self._receive()).type == P.TOKEN:
            first = first or time.perf_counter()
            yield from on_tokens(msg.fields.get("tokens") or [], msg.fields["text"])
        f = expect(msg, P.DONE).fields
        costs = self._link.costs if self.pacer is not None else None
        if costs is not None and first is not None and len(f["tokens"]) > 1:
            n = len(f["tokens"]) - 1  # decoded after the first token came
            target_s = f["stats"].get("verify_s", 0.0) * n / len(f["tokens"])  # the server's decode forwards
            self.pacer.observe(False, n, time.perf_counter() - first, target_s,
                               n * costs.decode(len(prompt) + len(f["tokens"]) / 2))
        return f


def _text_chunk(_ids: list[int], text: str) -> Iterator[Chunk]:
    if text:
        yield Chunk(text)


class AsyncEdgeSession:
    """asyncio front of EdgeSession: its blocking work (network, ONNX Runtime) runs in a worker thread.

        session = await AsyncEdgeSession.open(bundle, server)
        async for chunk in session.generate("Hello!"):
            print(chunk, end="")
        await session.close()
    """

    def __init__(self, session: EdgeSession):
        self.session = session

    @classmethod
    async def open(cls, *args: Any, **kwargs: Any) -> "AsyncEdgeSession":
        """Takes EdgeSession's arguments."""
        return cls(await asyncio.to_thread(EdgeSession, *args, **kwargs))

    async def generate(self, prompt: Prompt, **kwargs: Any) -> AsyncIterator[Chunk]:
        """Like EdgeSession.generate."""
        chunks = self.session.generate(prompt, **kwargs)
        while (chunk := await asyncio.to_thread(next, chunks, None)) is not None:
            yield chunk

    @property
    def stats(self) -> Stats:
        return self.session.stats

    @property
    def result(self) -> Result | None:
        return self.session.result

    async def close(self) -> None:
        await asyncio.to_thread(self.session.close)
