"""Link emulation on one machine: a TCP proxy that adds round-trip delay, jitter and a bandwidth cap.

    with LinkProxy("127.0.0.1", server_port, parse_link("4g")) as proxy:
        EdgeSession(bundle, proxy.url)                       # the edge talks to the server through a 4G-like link

Each direction delays every chunk it forwards by half the round trip plus a uniform jitter in [-jitter/2,
+jitter/2] (never below 0, never reordered: TCP delivers in order), after the chunk has gone through the bandwidth
cap (bytes * 8 / bandwidth seconds on a per-direction link clock, so a burst queues as on a real link). No loss.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from dataclasses import dataclass

from bench.runs import BenchError

CHUNK = 1 << 16


@dataclass(frozen=True)
class LinkProfile:
    """A network link: round-trip time and jitter in milliseconds, bandwidth in Mbit/s each way (None: no cap)."""

    name: str
    rtt_ms: float = 0.0
    jitter_ms: float = 0.0
    bandwidth_mbit: float | None = None

    def __str__(self) -> str:
        bw = f"{self.bandwidth_mbit:g} Mbit/s" if self.bandwidth_mbit else "no cap"
        return f"{self.name} (rtt {self.rtt_ms:g} ms, jitter {self.jitter_ms:g} ms, {bw})"


PRESETS = {
    "none": LinkProfile("none"),  # loopback as is
    "lan": LinkProfile("lan", 1.0, 0.2, 1000.0),
    "wifi": LinkProfile("wifi", 10.0, 4.0, 50.0),
    "4g": LinkProfile("4g", 60.0, 15.0, 10.0),
}


def parse_link(spec: str) -> LinkProfile:
    """`lan`, `wifi`, `4g`, `none`, or `rtt=MS[,bw=MBIT][,jitter=MS]` (ValueError otherwise)."""
    spec = spec.strip()
    if spec in PRESETS:
        return PRESETS[spec]
    fields: dict[str, float] = {}
    for part in spec.split(","):
        key, sep, value = part.partition("=")
        if not sep or key.strip() not in ("rtt", "bw", "jitter"):
            raise ValueError(f"link {spec!r}: expected one of {', '.join(PRESETS)} or rtt=MS[,bw=MBIT][,jitter=MS]")
        try:
            fields[key.strip()] = float(value)
        except ValueError:
            raise ValueError(f"link {spec!r}: {key} needs a number, got {value!r}") from None
    if "rtt" not in fields:
        raise ValueError(f"link {spec!r}: rtt=MS is required")
    if fields["rtt"] < 0 or fields.get("jitter", 0) < 0 or fields.get("bw", 1) <= 0:
        raise ValueError(f"link {spec!r}: rtt and jitter must not be negative, bw must be positive")
    return LinkProfile(spec, fields["rtt"], fields.get("jitter", 0.0), fields.get("bw"))


class LinkProxy:
    """A loopback TCP proxy in front of host:port with a link profile; runs its own event loop in a thread."""

    def __init__(self, host: str, port: int, profile: LinkProfile, seed: int = 0):
        self.host, self.port, self.profile = host, port, profile
        self.rng = random.Random(seed)
        self.listen_port = 0
        self.bytes = {"up": 0, "down": 0}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._tasks: set[asyncio.Task] = set()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True, name="link-proxy")

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.listen_port}"

    def delay_s(self) -> float:
        p = self.profile
        return max(0.0, p.rtt_ms / 2 + self.rng.uniform(-p.jitter_ms / 2, p.jitter_ms / 2)) / 1000

    async def _main(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.listen_port = server.sockets[0].getsockname()[1]
        self._ready.set()
        async with server:
            await self._stop.wait()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        try:
            server_r, server_w = await asyncio.open_connection(self.host, self.port)
        except OSError:
            client_w.close()
            return
        try:
            await asyncio.gather(self._pipe(client_r, server_w, "up"), self._pipe(server_r, client_w, "down"),
                                 return_exceptions=True)
        except asyncio.CancelledError:
            # the proxy is closing. Ending normally: Python 3.11's stream server calls exception() on a cancelled
            # connection task and logs a traceback
            pass

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, direction: str) -> None:
        """Forward one direction: chunks pass the bandwidth cap, then the delay; in order."""
        queue: asyncio.Queue = asyncio.Queue()
        bw = self.profile.bandwidth_mbit

        async def deliver() -> None:
            while (item := await queue.get()) is not None:
                at, data = item
                if (wait := at - time.monotonic()) > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()
            writer.close()

        sender = asyncio.ensure_future(deliver())
        link_free = last = 0.0
        try:
            while data := await reader.read(CHUNK):
                self.bytes[direction] += len(data)
                now = time.monotonic()
                link_free = max(now, link_free) + (len(data) * 8 / (bw * 1e6) if bw else 0.0)
                last = max(last, link_free + self.delay_s())
                queue.put_nowait((last, data))
        except (ConnectionError, OSError):
            pass
        finally:
            queue.put_nowait(None)
            try:
                await sender
            except (ConnectionError, OSError):
                pass

    def __enter__(self) -> "LinkProxy":
        self._thread.start()
        if not self._ready.wait(30):
            raise BenchError("the link proxy did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)
