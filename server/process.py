"""`python -m server` as a child process on a free loopback port: for the demo, the client-server benchmark and
the tests that need a real server process (one they can kill)."""

from __future__ import annotations

import os
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerStartError(RuntimeError):
    """The server process exited, or stayed silent, before it answered its health check (the message holds its log)."""


class ServerProcess:
    """`python -m server ARGS --port P` on 127.0.0.1; `env` is added to the environment (e.g. MOA_TOKENS).

        with ServerProcess(["--drafter", "eagle"]) as server:   # started and ready
            ... server.url ...
    """

    def __init__(self, args: list[str], env: dict[str, str] | None = None, port: int | None = None):
        self.args, self.env = list(args), dict(env or {})
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def tls(self) -> bool:
        return "--certfile" in self.args

    @property
    def url(self) -> str:
        return f"{'wss' if self.tls else 'ws'}://127.0.0.1:{self.port}"

    def start(self) -> "ServerProcess":
        env = {**os.environ, "PYTHONPATH": str(ROOT), **self.env}
        self.log = tempfile.TemporaryFile("w+")  # a file, not a pipe: a full pipe would block the server
        self.proc = subprocess.Popen([sys.executable, "-m", "server", *self.args, "--port", str(self.port)], cwd=ROOT,
                                     env=env, stderr=self.log, text=True)
        return self

    def wait_ready(self, timeout: float = 600) -> "ServerProcess":
        """Poll GET /healthz; a server that exits or stays silent past `timeout` raises with its log."""
        deadline = time.monotonic() + timeout
        scheme, context = ("https", ssl._create_unverified_context()) if self.tls else ("http", None)
        while True:
            try:
                with urllib.request.urlopen(f"{scheme}://127.0.0.1:{self.port}/healthz", timeout=5, context=context):
                    return self
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.log.seek(0)
                    raise ServerStartError(f"the verify server ({' '.join(self.args)}) did not start:\n{self.log.read()}")
                time.sleep(0.2)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.kill()

    def kill(self) -> None:
        """A crash: SIGKILL, no goodbye to the clients."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def __enter__(self) -> "ServerProcess":
        try:
            return self.start().wait_ready()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()
