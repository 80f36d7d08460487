"""Server settings and the `moa-server` command line."""

from __future__ import annotations

import argparse
import ssl
from dataclasses import dataclass, field
from typing import Any

from moa_core.tree import TreeConfig
from server.auth import TOKENS_ENV, load_tokens

DEVICES = ("auto", "cuda", "cpu")
DTYPES = ("auto", "float32", "float16", "bfloat16")
QUANTIZE = ("none", "int8")  # models.target.QUANTIZE, without importing torch before --help

EPILOG = f"""\
endpoints (one port):
  ws[s]://HOST:PORT/   the edge protocol (docs/protocol.md): binary frames, one session per transcript
  GET /healthz         200 + JSON status
  GET /metrics         Prometheus text: sessions, requests by type, errors by code, accepted tokens,
                       target seconds, bytes in/out, compute queue, busy seconds, target forwards;
                       batching: moa_batch_size, moa_batch_tokens, moa_batch_queue_seconds,
                       moa_batch_forward_seconds (histograms); speculation: moa_spec_decode_num_drafts_total,
                       moa_spec_decode_num_accepted_tokens_per_pos_total{{position}}, moa_spec_decode_acceptance_length

authentication:
  Tokens come from --tokens-file (one per line, # comments) and ${TOKENS_ENV} (comma-separated). Clients send
  `Authorization: Bearer <token>` in the websocket handshake (a wrong token gets HTTP 401) or hello.auth.
  Sessions belong to the token that opened them. With no token configured the server is open (warning logged).

compute:
  Model work runs off the event loop. --batching on (default): the target forwards of all sessions that are
  ready at the same moment (verify trees, prefill chunks, resume chunks, generate's decode steps) run as one
  packed forward (continuous batching), up to --batch-tokens new tokens and --max-batch sessions; a first
  request waits for the other sessions in flight at most --batch-wait-ms and a quarter of a forward. --batching off: one
  computation at a time in arrival order (fair FIFO); `generate` gives the lane back after every decoding
  round, a long prefill or resume after every --prefill-chunk tokens.

examples:
  moa-server                                   default target + shipped MoA drafter on 127.0.0.1:8765
  moa-server --host 0.0.0.0 --tokens-file tokens.txt --certfile cert.pem --keyfile key.pem
  moa-server --target meta-llama/Llama-3.1-8B-Instruct --drafter runs/llama-moa --device cuda --dtype float16
"""


@dataclass(frozen=True)
class Limits:
    max_sessions: int = 64
    max_context: int = 4096
    max_tree_tokens: int = 128
    max_message_bytes: int = 1 << 20
    idle_timeout_s: float = 300.0
    max_sessions_per_token: int = 16  # sessions one credential may hold (with tokens configured)
    hello_timeout_s: float = 10.0  # a connection that sends no hello within this is closed
    prefill_chunk: int = 256  # tokens per target forward of a prefill/resume; other sessions run in between

    def public(self) -> dict[str, Any]:
        """The limits a `welcome` announces."""
        return {"max_context": self.max_context, "max_tree_tokens": self.max_tree_tokens,
                "max_message_bytes": self.max_message_bytes, "idle_timeout_s": self.idle_timeout_s}


@dataclass(frozen=True)
class Batching:
    """The batching scheduler (models/batching.py); enabled False = the FIFO compute lane."""

    enabled: bool = True
    max_wait_ms: float = 20.0  # longest wait after a first request for the others in flight (and <= 1/4 forward)
    max_batch_tokens: int = 512  # new tokens per forward (a longer request runs alone)
    max_batch_size: int = 64  # sessions per forward


@dataclass
class ServerConfig:
    target: str = "default"
    drafter: str = "default"  # the memory head: a path, default | moa | eagle (shipped), or none (generate only)
    tree: str = "auto"  # server-side drafting budget for generate with drafter=server
    host: str = "127.0.0.1"
    port: int = 8765
    device: str = "auto"
    dtype: str = "auto"
    quantize: str = "none"  # none | int8 (models.registry.load_target)
    threads: int | None = None
    tokens: tuple[str, ...] = ()
    certfile: str | None = None
    keyfile: str | None = None
    limits: Limits = field(default_factory=Limits)
    log_level: str = "info"
    batching: Batching = field(default_factory=Batching)

    @property
    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    @property
    def resolved_dtype(self) -> str:
        """auto: float32 on CPU, float16 on CUDA (bfloat16 would change the weight fingerprints)."""
        if self.dtype != "auto":
            return self.dtype
        return "float16" if self.resolved_device == "cuda" else "float32"

    def ssl_context(self) -> ssl.SSLContext | None:
        """A TLS context when a certificate is configured (the server then speaks wss://)."""
        if not self.certfile:
            return None
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(self.certfile, self.keyfile)
        return context


def build_parser() -> argparse.ArgumentParser:
    d, lim = ServerConfig(), Limits()
    p = argparse.ArgumentParser(prog="moa-server", description="Speculative-decoding verify server: hosts the target "
                                "LLM, verifies the edge's draft trees and sends back the drafter's memory rows.",
                                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    m = p.add_argument_group("model")
    m.add_argument("--target", default=d.target, help="target LLM: 'default' (SmolLM2-135M-Instruct), a Hugging Face "
                   "id in the local cache or a local path (Llama / Qwen2 / Mistral) (default: %(default)s)")
    m.add_argument("--drafter", default=d.drafter, help="drafter whose memory head computes the memory rows: "
                   "'default' (shipped MoA), 'moa', 'eagle', a checkpoint directory, or 'none' to serve only "
                   "generate; also drafts server-side for generate with drafter=server (default: %(default)s)")
    m.add_argument("--tree", default=d.tree, help="server-side draft tree 'depth,topk,total' or 'auto' (measured "
                   "cost model) (default: %(default)s)")
    m.add_argument("--device", choices=DEVICES, default=d.device, help="default: %(default)s (cuda when present)")
    m.add_argument("--dtype", choices=DTYPES, default=d.dtype, help="weights dtype; auto = float32 on CPU, float16 on "
                   "CUDA (default: %(default)s)")
    m.add_argument("--quantize", choices=QUANTIZE, default=d.quantize, help="target Linear layers: none (as loaded) or "
                   "int8 (int8 weights and activations, CPU: about 2x faster, but it changes the model's greedy text; "
                   "see the README) (default: %(default)s)")
    m.add_argument("--threads", type=int, default=d.threads, help="torch CPU threads (default: torch's choice)")
    n = p.add_argument_group("network and security")
    n.add_argument("--host", default=d.host, help="bind address (default: %(default)s)")
    n.add_argument("--port", type=int, default=d.port, help="port, 0 = any free one (default: %(default)s)")
    n.add_argument("--tokens-file", help=f"file of accepted bearer tokens, one per line (also: ${TOKENS_ENV}, "
                   "comma-separated); none configured = open server")
    n.add_argument("--certfile", help="TLS certificate chain (PEM): serve wss://")
    n.add_argument("--keyfile", help="TLS private key (PEM), if not inside --certfile")
    g = p.add_argument_group("limits")
    g.add_argument("--max-sessions", type=int, default=lim.max_sessions, help="default: %(default)s")
    g.add_argument("--max-context", type=int, default=lim.max_context, help="tokens per session (default: %(default)s)")
    g.add_argument("--max-tree-tokens", type=int, default=lim.max_tree_tokens,
                   help="tokens per verify, root included (default: %(default)s)")
    g.add_argument("--max-message-bytes", type=int, default=lim.max_message_bytes,
                   help="largest incoming frame; bigger ones close the connection with 1009 (default: %(default)s)")
    g.add_argument("--idle-timeout", type=float, default=lim.idle_timeout_s,
                   help="seconds a session without a connection is kept for resume (default: %(default)s)")
    g.add_argument("--max-sessions-per-token", type=int, default=lim.max_sessions_per_token,
                   help="sessions one bearer token may hold (default: %(default)s)")
    g.add_argument("--hello-timeout", type=float, default=lim.hello_timeout_s,
                   help="seconds a new connection has to send hello before it is closed (default: %(default)s)")
    g.add_argument("--prefill-chunk", type=int, default=lim.prefill_chunk,
                   help="tokens per target forward of a long prefill or resume; other sessions' requests run "
                   "between chunks (default: %(default)s)")
    b = p.add_argument_group("batching")
    bd = Batching()
    b.add_argument("--batching", choices=("on", "off"), default="on", help="on: concurrent sessions' forwards run "
                   "as one (continuous batching); off: one computation at a time, FIFO (default: %(default)s)")
    b.add_argument("--batch-wait-ms", type=float, default=bd.max_wait_ms, help="longest wait after a first request "
                   "for the other sessions in flight, and at most a quarter of the last forward's duration "
                   "(default: %(default)s)")
    b.add_argument("--batch-tokens", type=int, default=bd.max_batch_tokens, help="new tokens per batched forward "
                   "(default: %(default)s)")
    b.add_argument("--max-batch", type=int, default=bd.max_batch_size, help="sessions per batched forward "
                   "(default: %(default)s)")
    p.add_argument("--log-level", default=d.log_level, choices=("debug", "info", "warning", "error"),
                   help="default: %(default)s")
    return p


def parse_args(argv: list[str] | None = None) -> ServerConfig:
    """The configuration; every argument is checked here, before any model loads (errors exit with status 2)."""
    parser = build_parser()
    a = parser.parse_args(argv)
    if a.keyfile and not a.certfile:
        parser.error("--keyfile needs --certfile")
    if not 0 <= a.port <= 65535:
        parser.error(f"--port {a.port} is not in 0..65535")
    for flag in ("max_sessions", "max_context", "max_tree_tokens", "max_message_bytes", "max_sessions_per_token",
                 "prefill_chunk", "threads", "batch_tokens", "max_batch"):
        if getattr(a, flag) is not None and getattr(a, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    if a.tree != "auto":
        try:
            TreeConfig.parse(a.tree)
        except ValueError as e:
            parser.error(str(e))
    for flag in ("idle_timeout", "hello_timeout"):
        if not getattr(a, flag) > 0:
            parser.error(f"--{flag.replace('_', '-')} must be positive")
    if not a.batch_wait_ms >= 0:
        parser.error("--batch-wait-ms must not be negative")
    try:
        tokens = load_tokens(a.tokens_file)
        config = ServerConfig(a.target, a.drafter, a.tree, a.host, a.port, a.device, a.dtype, a.quantize, a.threads,
                              tokens, a.certfile, a.keyfile, log_level=a.log_level, limits=Limits(
                                  a.max_sessions, a.max_context, a.max_tree_tokens, a.max_message_bytes,
                                  a.idle_timeout, a.max_sessions_per_token, a.hello_timeout, a.prefill_chunk),
                              batching=Batching(a.batching == "on", a.batch_wait_ms, a.batch_tokens, a.max_batch))
        config.ssl_context()
    except (OSError, ssl.SSLError) as e:
        parser.error(f"cannot read {e.filename or 'the TLS certificate or key'}: {e.strerror or e}")
    return config
