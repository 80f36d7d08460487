"""`make demo`: the main job on the default model, edge client and verify server on this machine.

1. Refresh the default edge bundle if needed (exported from the shipped MoA drafter on first use, or when the
   drafter is newer than the bundle).
2. Start the verify server (`python -m server`: SmolLM2-135M-Instruct + the shipped MoA drafter's memory head)
   on a free loopback port.
3. Run the edge client (the Python API behind `moa-edge`) on a sample prompt: it drafts in ONNX Runtime, the
   server verifies; the text streams, then its figures (tau, tokens/s, server calls, bytes) next to `api` mode
   (the server generates alone, the usual deployment) on the same prompt.
4. Stop the server.

    python demo.py ["your prompt"]
"""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import time
import urllib.request

from edge_client.__main__ import status_line
from edge_client.client import EdgeError, EdgeSession, default_bundle

PROMPT = "Explain in a few sentences why the sky is blue."
MAX_NEW_TOKENS = 128


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(server: subprocess.Popen, port: int, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5):
                return
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                sys.exit("demo: the verify server did not start (see its log above)")
            time.sleep(0.5)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="[moa-edge] %(message)s")
    prompt = " ".join(sys.argv[1:]) or PROMPT
    try:
        bundle = default_bundle()
    except EdgeError as e:
        sys.exit(f"demo: {e}")
    port = free_port()
    url = f"ws://127.0.0.1:{port}"
    print(f"starting the verify server on {url} (default target + shipped MoA drafter)", flush=True)
    server = subprocess.Popen([sys.executable, "-m", "server", "--port", str(port), "--log-level", "warning"])
    try:
        wait_ready(server, port)
        print(f"\n$ moa-edge --server {url} --max-new-tokens {MAX_NEW_TOKENS} {prompt!r}\n", flush=True)
        with EdgeSession(bundle, url) as spec, EdgeSession(bundle, url, mode="api") as api:
            for chunk in spec.generate(prompt, max_new_tokens=MAX_NEW_TOKENS):
                print(chunk, end="", flush=True)
            print(f"\n\nMoA edge + server: {status_line(spec)}")
            baseline = api.complete(prompt, max_new_tokens=MAX_NEW_TOKENS)
            print(f"API (server only): {status_line(api)}")
            print(f"same text: {baseline.token_ids == spec.result.token_ids}")
    except EdgeError as e:
        sys.exit(f"demo: {e}")
    finally:
        server.terminate()
        server.wait(60)


if __name__ == "__main__":
    main()
