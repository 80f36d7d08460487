"""Faults against the edge client, on real processes (verify servers on loopback, the edge CLI, ONNX Runtime): a
server that resets during the handshake, SIGKILL and restart mid-generation, a server that comes back with another
drafter or target, a generation that starts offline, wss:// with a private CA. Nothing shown is lost or repeated, and under
`--on-reconnect verify` greedy output equals the server's own (api) output whenever the server comes back within
the wait; when it does not, the exit status and --json say how many tokens are unverified."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterator

import pytest
import torch

from edge_client.client import EdgeSession, Link, LinkDown
from export.to_onnx import export_bundle
from models.registry import build_drafter
from server.process import ServerProcess
from tests.helpers import FAST_BACKOFF, NEW, PROMPT, TOKEN, TREE, ResetServer, apply, edge_cli, pull_until, \
    varied_target, verify_server

WAIT_S = 300  # bounds every wait below; none is a timing assertion


@pytest.fixture(scope="module")
def rig(tmp_path_factory) -> Iterator[dict]:
    """A target, its trained drafter and bundle, another drafter (another fingerprint) and a reference server."""
    root = tmp_path_factory.mktemp("faults")
    target = varied_target(root / "target")
    torch.manual_seed(0)
    build_drafter("moa", target).save_pretrained(root / "drafter")  # no training: nothing here needs acceptance
    build_drafter("moa", target).save_pretrained(root / "other")
    main = verify_server(root / "target", root / "drafter").start()
    export_bundle(root / "drafter", root / "bundle", "fp32", target, parity_prompts=(PROMPT,), heldout_prompts=(),
                  log=lambda s: None)
    try:
        main.wait_ready()
        with EdgeSession(root / "bundle", main.url, TOKEN, mode="api", threads=1) as api:
            reference = api.complete(PROMPT, max_new_tokens=NEW).token_ids
        yield {"root": root, "bundle": root / "bundle", "main": main, "reference": reference}
    finally:
        main.kill()


@pytest.fixture
def crash(rig) -> Iterator[ServerProcess]:
    """A verify server of this test's own, to kill."""
    server = verify_server(rig["root"] / "target", rig["root"] / "drafter")
    with server:
        yield server


def session(rig: dict, server: ServerProcess, **kw) -> EdgeSession:
    return EdgeSession(rig["bundle"], server.url, TOKEN, threads=1, tree=TREE, backoff_s=FAST_BACKOFF,
                       on_reconnect="verify", resync_wait_s=WAIT_S, **kw)


def wait_until(done: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not done():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.05)


def drain(chunks: Iterator) -> Future:
    """Consume a generation in a worker thread (it may block waiting for the server)."""
    return ThreadPoolExecutor(1).submit(list, chunks)


def test_reset_in_the_handshake_is_a_clear_link_error(rig):
    with ResetServer() as reset:
        url = f"ws://127.0.0.1:{reset.port}"
        for _ in range(200):  # the reset lands at every stage of the handshake over these
            with pytest.raises(LinkDown):
                Link.open(url, None, "fingerprint", "fp16", 5)
        out = edge_cli(PROMPT, "--bundle", str(rig["bundle"]), "--server", url)
    assert out.returncode == 1 and "cannot reach" in out.stderr and "Traceback" not in out.stderr
    assert reset.resets > 200


def test_kill_resetting_server_then_restart_resyncs_to_the_api_text(rig, crash):
    with session(rig, crash) as s:
        chunks = s.generate(PROMPT, max_new_tokens=NEW)
        shown = pull_until(chunks, lambda: s.length - len(s.prompt) >= 8)
        crash.kill()
        rest = drain(chunks)
        with ResetServer(crash.port) as reset:  # the reconnect thread meets resets during its handshakes
            wait_until(lambda: reset.resets >= 10, "reconnect attempts")
        crash.start().wait_ready()
        shown += rest.result(WAIT_S)
        assert s.result.token_ids == rig["reference"] and s.result.verified
        assert apply(shown) == s.result.text
        assert s.stats.reconnects == 1 and s.stats.offline_tokens > 0
        print(f"\nfault: SIGKILL, {reset.resets} handshake resets, restart: {s.stats.offline_tokens} offline tokens, "
              f"{s.stats.rewound_tokens} rewound, output equal to api")


def test_cli_verify_waits_for_the_server_instead_of_ending_unverified(rig):
    """The issue's case: offline generation outruns the reconnect (--offline-for 2)."""
    out = edge_cli(PROMPT, "--bundle", str(rig["bundle"]), "--server", rig["main"].url, "--token", TOKEN, "--tree",
                   TREE, "--max-new-tokens", str(NEW), "--on-reconnect", "verify", "--disconnect-after", "8",
                   "--offline-for", "2", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["token_ids"] == rig["reference"] and result["verified"] is True
    assert result["unverified_tokens"] == 0 and result["stats"]["reconnects"] == 1
    assert "waiting up to" in out.stderr


def test_cli_verify_says_when_the_server_does_not_come_back(rig):
    out = edge_cli(PROMPT, "--bundle", str(rig["bundle"]), "--server", rig["main"].url, "--token", TOKEN, "--tree",
                   TREE, "--max-new-tokens", str(NEW), "--on-reconnect", "verify", "--disconnect-after", "8", "--json")
    assert out.returncode == 3, out.stderr
    result = json.loads(out.stdout)
    stats = result["stats"]
    assert result["verified"] is False and result["unverified_tokens"] == stats["offline_tokens"] > 0
    assert result["token_ids"][:8] == rig["reference"][:8] and "never verified" in out.stderr


def test_generation_that_starts_offline_is_verified_when_the_server_returns(rig, crash):
    with session(rig, crash) as s:
        crash.kill()
        chunks = s.generate(PROMPT, max_new_tokens=NEW)
        shown = pull_until(chunks, lambda: s.stats.offline_tokens >= 4)
        rest = drain(chunks)
        crash.start().wait_ready()
        shown += rest.result(WAIT_S)
        assert s.result.token_ids == rig["reference"] and s.result.verified
        assert apply(shown) == s.result.text and s.stats.rewound_tokens > 0
        print(f"\nfault: started offline: {s.stats.offline_tokens} offline tokens, {s.stats.rewound_tokens} rewound, "
              "output equal to api")


@pytest.mark.parametrize("other", ["drafter", "target"])
def test_restart_with_another_model_finishes_offline_and_loses_nothing(rig, crash, other):
    with session(rig, crash) as s:
        chunks = s.generate(PROMPT, max_new_tokens=NEW)
        shown = pull_until(chunks, lambda: s.length - len(s.prompt) >= 8)
        verified = s.length - len(s.prompt)
        crash.kill()
        server = verify_server(rig["root"] / "target", rig["root"] / "other") if other == "drafter" else \
            ServerProcess(["--target", "tiny", "--drafter", "none", "--threads", "1"], env=crash.env)
        server.port = crash.port
        with server:  # the same address now serves another memory head or target: the fingerprint differs
            shown += drain(chunks).result(WAIT_S)
        out = s.result.token_ids
        assert out[:verified] == rig["reference"][:verified] and len(out) == NEW
        assert s.result.unverified == s.stats.offline_tokens > 0 and not s.online
        assert apply(shown) == s.result.text == s.tokenizer.decode(out)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_wss_with_a_private_ca_file(rig, tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"], check=True,
                   capture_output=True, timeout=120)
    server = verify_server(rig["root"] / "target", rig["root"] / "drafter")
    server.args += ["--certfile", str(cert), "--keyfile", str(key)]
    with server:
        args = (PROMPT, "--bundle", str(rig["bundle"]), "--server", server.url, "--token", TOKEN, "--tree", TREE,
                "--max-new-tokens", "16", "--json")
        untrusted = edge_cli(*args)
        trusted = edge_cli(*args, "--ca-file", str(cert))
    assert untrusted.returncode == 1 and "CERTIFICATE_VERIFY_FAILED" in untrusted.stderr
    assert trusted.returncode == 0, trusted.stderr
    assert json.loads(trusted.stdout)["token_ids"] == rig["reference"][:16]


def test_edge_cli_argument_errors_come_before_the_bundle_loads(tmp_path):
    missing = str(tmp_path / "no-bundle")
    cases = [(["--providers", "bogus"], "invalid choice: 'bogus'"),
             (["--tree", "3,2"], "depth,topk,total_tokens"),
             (["--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
             (["--temperature", "5e-324"], "--temperature 5e-324"),
             (["--ca-file", str(tmp_path / "ca.pem"), "--server", "wss://127.0.0.1:1"], "no such file"),
             (["--ca-file", str(tmp_path)], "is for a wss:// server"),
             (["--bundle", missing], "no such directory")]
    for args, message in cases:
        out = edge_cli(PROMPT, *(["--bundle", missing] if "--bundle" not in args else []), *args)
        assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr, (args, out.stderr)


def test_server_cli_errors_come_before_the_model_loads(tmp_path):
    import socket
    import sys

    def server_cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "server", "--target", str(tmp_path / "no-model"), *args],
                              cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=120)

    with socket.create_server(("127.0.0.1", 0)) as taken:
        cases = [(["--tokens-file", str(tmp_path / "tokens.txt")], 2, "cannot read"),
                 (["--port", "99999"], 2, "--port 99999 is not in 0..65535"),
                 (["--tree", "3,2"], 2, "depth,topk,total_tokens"),
                 (["--max-context", "0"], 2, "--max-context must be at least 1"),
                 (["--port", str(taken.getsockname()[1])], 1, "cannot listen on")]
        for args, status, message in cases:
            out = server_cli(*args)
            assert out.returncode == status and message in out.stderr and "Traceback" not in out.stderr, \
                (args, out.stderr)
            assert "no-model" not in out.stderr  # the target was never looked at
