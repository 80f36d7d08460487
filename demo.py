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
import sys

from edge_client.__main__ import status_line
from edge_client.client import EdgeError, EdgeSession, default_bundle
from server.process import ServerProcess

PROMPT = "Explain in a few sentences why the sky is blue."
MAX_NEW_TOKENS = 128


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="[moa-edge] %(message)s")
    prompt = " ".join(sys.argv[1:]) or PROMPT
    try:
        bundle = default_bundle()
    except EdgeError as e:
        sys.exit(f"demo: {e}")
    server = ServerProcess(["--log-level", "warning"])
    print(f"starting the verify server on {server.url} (default target + shipped MoA drafter)", flush=True)
    try:
        with server:
            url = server.url
            print(f"\n$ moa-edge --server {url} --max-new-tokens {MAX_NEW_TOKENS} {prompt!r}\n", flush=True)
            with EdgeSession(bundle, url) as spec, EdgeSession(bundle, url, mode="api", copy_tokens=0) as api:
                for chunk in spec.generate(prompt, max_new_tokens=MAX_NEW_TOKENS):
                    print(chunk, end="", flush=True)
                print(f"\n\nMoA edge + server: {status_line(spec)}")
                baseline = api.complete(prompt, max_new_tokens=MAX_NEW_TOKENS)
                print(f"API (server only): {status_line(api)}")
                print(f"same text: {baseline.token_ids == spec.result.token_ids}")
    except (EdgeError, RuntimeError) as e:
        sys.exit(f"demo: {e}")


if __name__ == "__main__":
    main()
