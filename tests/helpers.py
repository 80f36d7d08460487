"""Shared test helpers: quickly trained tiny drafters, so that speculative paths really get accepted; the edge's
I/O-free core driven over a plain protocol client; a server that resets every connection; tree masks; the
chi-square check that sampling keeps the target's distribution of the first two tokens; the tiny target, servers and
CLI of the client tests; a subprocess where torch and transformers cannot be imported."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import threading
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import torch

from edge_client.client import Chunk
from edge_client.core import EdgeCore, Request, State, Stats
from moa_core import protocol as P
from moa_core.drafting import DraftSession, DraftStep
from moa_core.generation import StopRule
from moa_core.tree import TreeConfig, ancestor_matrix
from models.data import Encoded
from models.drafter import trainable_parameters
from models.registry import build_drafter, load_target
from models.tiny import tiny_target
from models.train import TrainConfig, collate, train_step_loss
from models.verify import target_probs, verify_tree
from server.process import ServerProcess


def tree_attention_mask(parents: list[int], dtype: torch.dtype) -> torch.Tensor:
    """Float additive mask (n, n) for a tree given as parent indices: node i sees itself and its ancestors."""
    visible = torch.from_numpy(ancestor_matrix(np.asarray(parents)))
    return torch.zeros(visible.shape, dtype=dtype).masked_fill(~visible, float("-inf"))


def greedy_continuations(target, n: int, prompt_len: int = 6, new: int = 40, seed: int = 0) -> list[Encoded]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(3, target.spec.vocab_size, (prompt_len,), generator=g).tolist()
        runner = target.new_runner()
        step = runner.forward(ids)
        for _ in range(new):
            ids.append(int(step.logits[-1].argmax()))
            step = runner.forward(ids[-1:])
        out.append(Encoded(str(i), ids, [0] * prompt_len + [1] * new))
    return out


def lossless_forwards(target, engine, max_new_tokens: int = 40) -> tuple[int, int]:
    """Greedy output of `engine` equals vanilla decoding on five prompts; returns both runs' target forwards."""
    from models.engine import SpeculativeEngine

    vanilla = SpeculativeEngine(target, None)
    forwards = [0, 0]
    for sample in greedy_continuations(target, 3, seed=0) + greedy_continuations(target, 2, seed=7):
        prompt = sample.ids[:6]
        a = vanilla.generate(prompt, max_new_tokens=max_new_tokens)
        b = engine.generate(prompt, max_new_tokens=max_new_tokens)
        assert a.token_ids == b.token_ids
        forwards[0] += a.stats.target_forwards
        forwards[1] += b.stats.target_forwards
    return forwards[0], forwards[1]


def train_tiny(target, arch: str, steps: int = 150, seed: int = 0, **sizes):
    """A drafter distilled from the tiny target's own greedy text: high acceptance in seconds."""
    torch.manual_seed(seed)
    data = greedy_continuations(target, 32, seed=seed)
    drafter = build_drafter(arch, target, **sizes).train()
    params = trainable_parameters(drafter)
    opt = torch.optim.AdamW(params, lr=3e-3)
    cfg = TrainConfig(sync_min=2, sync_max=6)
    for step in range(steps):
        batch = [data[(step * 8 + j) % len(data)] for j in range(8)]
        (loss, _), _ = train_step_loss(drafter, target, *collate(batch), cfg, step, 0.0)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return drafter.eval().requires_grad_(False)


class CoreClient:
    """An `EdgeCore` driven over a `server.testing.Client`, one request and its reply at a time: the edge's session
    state and requests without its reconnects and offline fallback (`edge_client.client` drives the same core).

    `session_id` is the connection's own session (from its welcome); `client` may be replaced by a new connection."""

    def __init__(self, client, session_id: str, step: DraftStep, row_width: int, tree: TreeConfig,
                 temperature: float = 0.0, seed: int = 0, seq: int = 0, policy: str = "keep", copy_tokens: int = 0):
        self.client, self.link_session = client, session_id
        self.core = EdgeCore(step, row_width, tree, policy, session_id=session_id, seq=seq, copy_tokens=copy_tokens)
        self.sampling = {"temperature": temperature, "top_p": 1.0, "top_k": 0}
        self.rng = np.random.default_rng(seed)
        self.stats = Stats("speculative")  # over every generation of this client

    @property
    def committed(self) -> list[int]:
        return self.core.tokens[:self.core.length]

    def call(self, request: Request) -> P.Message:
        """Send the request, return its reply; an `error` reply raises server.testing.ServerError."""
        return self.reply(P.decode(self.client.exchange(request.frame)))

    def reply(self, msg: P.Message) -> P.Message:
        from server.testing import ServerError

        if msg.type == P.ERROR:
            raise ServerError(msg)
        return msg

    def apply(self, msg: P.Message) -> list[int]:
        """Take a reply to the outstanding request."""
        return self.core.on_reply(self.reply(msg))

    def sync(self, lost: bool = False) -> P.Message:
        """Bring the server up to the core's transcript; the last reply."""
        self.core.begin_sync(self.link_session, lost)
        while self.core.state is State.RESYNCING:
            reply = self.call(self.core.sync_request())
            self.core.on_reply(reply)
        return reply

    def prefill(self, prompt: list[int]) -> None:
        """A new generation of `prompt`, synced."""
        self.core.start(prompt, self.sampling, self.stats)
        self.sync()

    def resume(self, policy: str) -> P.Message:
        """Back from offline: resume the offline tail under `policy`; the `resumed` reply."""
        self.core.policy = policy
        return self.sync()

    def round(self) -> list[int]:
        return self.apply(P.decode(self.client.exchange(self.core.verify_request(self.rng).frame)))

    def continue_until(self, prompt_len: int, max_new_tokens: int, eos: set[int]) -> list[int]:
        """Verify rounds until max_new_tokens or EOS; the generated (committed) tokens."""
        while len(self.committed) - prompt_len < max_new_tokens and not eos & set(self.committed[prompt_len:]):
            self.round()
        return StopRule(eos).cut(self.committed[prompt_len:], max_new_tokens)[0]

    def generate(self, prompt: list[int], max_new_tokens: int, eos: set[int]) -> list[int]:
        self.prefill(prompt)
        return self.continue_until(len(prompt), max_new_tokens, eos)


class ResetServer:
    """A loopback TCP server that accepts every connection and resets it at once (RST, no websocket handshake):
    `with ResetServer(port) as s:` ... `s.resets` connections reset so far."""

    def __init__(self, port: int = 0):
        self.sock = socket.create_server(("127.0.0.1", port))
        self.port = self.sock.getsockname()[1]
        self.resets = 0
        self._thread = threading.Thread(target=self._run, daemon=True, name="reset-server")

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()
            self.resets += 1

    def __enter__(self) -> "ResetServer":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self._thread.join(10)


def joint_first_two(tiny, prompt, root, sampling):
    """The exact target distribution of the two tokens after prompt + root."""
    p1 = target_probs(tiny.new_runner().forward(prompt + [root]).logits[-1], sampling)
    v = tiny.spec.vocab_size
    joint = torch.zeros(v, v, dtype=torch.float64)
    for t in range(v):
        if p1[t] > 0:
            r = tiny.new_runner()
            joint[t] = p1[t] * target_probs(r.forward(prompt + [root, t]).logits[-1], sampling)
    return joint


def first_two(runner, step, prompt, rows, root, sampling, g, rng, copy: list[int] | None = None) -> tuple[int, int]:
    """One draft-and-verify round after `prompt` (runner cropped back to it), with the `copy` chain grafted on: the
    first two tokens it yields."""
    runner.crop(len(prompt))
    session = DraftSession(step, candidates=runner.target.spec.vocab_size)
    session.add_verified(prompt, rows)
    tree = session.draft(root, TreeConfig(2, 3, 6), sampling.temperature, rng, copy)
    v = verify_tree(runner, root, tree, sampling, g)
    seq = v.accepted + [v.next_token]
    if len(seq) < 2:
        probs = target_probs(runner.forward(seq[:1]).logits[-1], sampling)
        seq.append(int(torch.multinomial(probs, 1, generator=g)))
    return tuple(seq[:2])


def chi_square_p(counts, joint, n):
    from scipy.stats import chisquare

    expected = (joint * n).flatten()
    observed = torch.zeros_like(expected)
    v = joint.shape[0]
    for (a, b), c in counts.items():
        observed[a * v + b] += c
    impossible = expected == 0  # top-k / top-p cut these: any sample there is a certain failure
    if observed[impossible].sum() > 0:
        return 0.0
    big = expected >= 5
    small = ~big & ~impossible
    obs, exp = observed[big], expected[big]
    if small.any():  # pool the rare cells into one bucket
        obs = torch.cat([obs, observed[small].sum().view(1)])
        exp = torch.cat([exp, expected[small].sum().view(1)])
    return chisquare(obs.numpy(), exp.numpy()).pvalue


# ---- the edge against real servers (test_client, test_faults) ------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "edge-test-token"
TREE = "4,2,8"
NEW = 48
PROMPT = "hello there"
FAST_BACKOFF = (0.05, 0.3)


def varied_target(path: Path):
    """The tiny Llama with an untied random LM head, saved as a Hugging Face model and loaded back as the server
    loads it. The shipped tiny target repeats one token; this one's greedy text varies, so offline text diverges."""
    target = tiny_target(dtype=torch.float32)
    model = target.model
    with torch.no_grad():
        weight = torch.randn(model.lm_head.weight.shape, generator=torch.Generator().manual_seed(1)) * 0.5
    model.lm_head.weight = torch.nn.Parameter(weight, requires_grad=False)
    model.config.tie_word_embeddings = False
    model.save_pretrained(path)
    target.tokenizer.save_pretrained(path)
    return load_target(str(path))


def verify_server(target: Path, drafter: Path) -> ServerProcess:
    """`python -m server` for the test target and drafter on a loopback port, with the test token."""
    return ServerProcess(["--target", str(target), "--drafter", str(drafter), "--threads", "1", "--log-level",
                          "warning"], env={"OMP_NUM_THREADS": "1", "MOA_TOKENS": TOKEN})


def apply(chunks: Iterable[Chunk], text: str = "") -> str:
    """What a reader of the stream sees: each chunk deletes `rewind` characters, then appends itself."""
    for chunk in chunks:
        text = text[:len(text) - chunk.rewind] + chunk
    return text


def pull_until(chunks: Iterator[Chunk], done) -> list[Chunk]:
    out = []
    while not done():
        out.append(next(chunks))
    return out


def edge_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "edge_client", "--threads", "1", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


# ---- edge-only code, where torch and transformers cannot be imported ------------------------------------------

BLOCKED = ("torch", "transformers")

BLOCKER = f"""
import sys
class _Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {BLOCKED!r}:
            raise ImportError("blocked on the edge: " + name)
sys.meta_path.insert(0, _Block())
"""


def run_blocked(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter where importing torch or transformers raises ImportError."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    script = BLOCKER + code + f"\nassert not {{m.split('.')[0] for m in sys.modules}} & set({BLOCKED!r})\n"
    return subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
