"""Verify-server state and operations, free of networking: the served model and one `Session` per edge transcript.

Every method here runs in a compute thread of `server.app`: one at a time in the FIFO lane, or concurrently with
other sessions' operations, their target forwards joined into batches (`Model.batcher`, models/batching.py; one
operation per session at a time either way). A session's operations
check everything that depends on its state before they touch it, so a refused request leaves it unchanged; one that
fails half-way is undone by `Session.recover`. Long target forwards (prefill, resume) run in chunks of
`Limits.prefill_chunk` tokens and call `pause` between them, where the compute lane serves other sessions.
Replies are encoded frames (docs/protocol.md); the last prefill/verify reply is kept for retries of its `seq`.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from moa_core import protocol as P
from moa_core.budget import MAX_TREE
from moa_core.tree import DraftTree
from models.batching import Batcher, Histogram
from models.costmodel import measure_costs
from models.drafter import Drafter, bundle_fingerprint, require_edge_drafter
from models.engine import SpeculativeEngine, TorchDraftStep
from models.target import Target, TargetRunner, TargetStep
from models.verify import Sampling, sample_token, verify_tree
from server.config import Batching, Limits


@dataclass
class Metrics:
    """Counters for /metrics; written by the compute lane and the event loop, one writer per counter."""

    requests: dict[str, int] = field(default_factory=dict)  # by message type
    errors: dict[str, int] = field(default_factory=dict)  # by error code
    accepted_tokens: int = 0  # draft tokens accepted by verify
    committed_tokens: int = 0  # tokens added to session transcripts (prefill, verify, resume)
    target_seconds: float = 0.0  # compute lane time: target forwards and memory rows
    bytes_in: int = 0
    bytes_out: int = 0
    busy_seconds: float = 0.0  # wall time with at least one computation in flight (server.app)
    drafts: int = 0  # verified trees
    draft_tokens: int = 0  # their nodes (the root excluded)
    accepted_per_position: dict[int, int] = field(default_factory=dict)  # accepted nodes by depth - 1
    acceptance_length: Histogram = field(default_factory=lambda: Histogram((1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16)))

    def count(self, table: dict[str, int], key: str) -> None:
        table[key] = table.get(key, 0) + 1

    def verified(self, tree_tokens: int, accepted: int) -> None:
        """One verify: `accepted` nodes of a `tree_tokens`-node tree (the accepted path holds depths 1..accepted)."""
        self.drafts += 1
        self.draft_tokens += tree_tokens
        for position in range(accepted):
            self.accepted_per_position[position] = self.accepted_per_position.get(position, 0) + 1
        self.acceptance_length.observe(1 + accepted)


def sampling_of(fields: dict[str, Any]) -> Sampling:
    """Sampling settings from message fields (absent = greedy); bad values -> bad_request."""
    temperature = fields.get("temperature") or 0.0
    top_p = 1.0 if fields.get("top_p") is None else fields["top_p"]
    top_k = fields.get("top_k") or 0
    if (problem := P.sampling_problem(temperature, top_p, top_k)) is not None:
        raise P.ProtocolError(problem, P.E_BAD_REQUEST)
    return Sampling(float(temperature), int(top_k), float(top_p))


def no_pause() -> None:
    """A `pause` that lets nothing else run."""


def forward_chunked(runner: TargetRunner, tokens: list[int], chunk: int, pause: Callable[[], None],
                    logits: str = "all") -> TargetStep:
    """The target over `tokens` appended to the runner's cache, `chunk` tokens per forward, `pause()` between.
    `logits`: "all" rows or the "last" one only (a prefill)."""
    steps = []
    for i in range(0, len(tokens), chunk):
        if i:
            pause()
        steps.append(runner.forward(tokens[i:i + chunk], logits=logits))
    if len(steps) == 1:
        return steps[0]
    head = torch.cat([s.logits for s in steps]) if logits == "all" else steps[-1].logits
    return TargetStep(head, *(torch.cat([getattr(s, name) for s in steps], dim) for name, dim in
                              (("hidden", 0), ("keys", 1), ("values", 1))))


class Model:
    """The served target and the drafter's memory head (the half of the drafter that runs where the target runs)."""

    def __init__(self, target: Target, drafter: Drafter | None, limits: Limits = Limits(), tree: str = "auto",
                 batching: Batching = Batching()):
        self.target = target
        self.drafter = drafter if drafter is None else require_edge_drafter(drafter)
        self.memory_head = TorchDraftStep(drafter) if drafter is not None else None
        self.limits = limits
        self.tree = tree  # server-side drafting budget for `generate` with drafter=server
        self.fingerprint = bundle_fingerprint(target, drafter)
        # what rounds cost here, for the edges' tree auto and pacing (welcome.costs)
        self.costs = measure_costs(target, self.memory_head, min(MAX_TREE, limits.max_tree_tokens)) if drafter else None
        self.metrics = Metrics()
        self._engines: dict[str, SpeculativeEngine] = {}
        self.batching = batching
        self.batcher = Batcher(target, batching.max_wait_ms / 1000, batching.max_batch_tokens,
                               batching.max_batch_size) if batching.enabled else None

    def new_runner(self) -> TargetRunner:
        """A target cache for one sequence; its forwards go through the batcher when batching is on."""
        return self.target.new_runner(self.batcher)

    @property
    def vocab_size(self) -> int:
        return self.target.spec.vocab_size

    @property
    def row_width(self) -> int:
        return self.drafter.row_width if self.drafter is not None else 0

    def require_memory_head(self) -> None:
        if self.memory_head is None:
            raise P.ProtocolError("this server runs without a drafter (--drafter none): it serves generate only",
                                  P.E_BAD_REQUEST)

    def rows(self, step: TargetStep, start: int, pause: Callable[[], None] = no_pause) -> np.ndarray:
        """Memory rows of the verified tokens in `step`, at positions start, start+1, ...: `prefill_chunk` tokens at
        a time, `pause()` between."""
        n, chunk = step.hidden.shape[0], self.limits.prefill_chunk
        parts = []
        for i in range(0, n, chunk):
            if i:
                pause()
            j = min(n, i + chunk)
            parts.append(self.memory_head.memory_rows(_slice(step, j, i), list(range(start + i, start + j))))
        return np.concatenate(parts) if len(parts) != 1 else parts[0]

    def engine(self, drafter: str) -> SpeculativeEngine:
        """The generation engine for `generate` (drafter none | server), built on first use."""
        if drafter == "server":
            self.require_memory_head()
        if drafter not in self._engines:
            self._engines[drafter] = SpeculativeEngine(self.target, self.drafter if drafter == "server" else None,
                                                       tree=self.tree, batcher=self.batcher, costs=self.costs)
        return self._engines[drafter]

    def generate(self, prompt: list[int], max_new_tokens: int, sampling: Sampling, drafter: str, seed: int | None,
                 emit: Callable[[str, list[int]], None], copy_tokens: int | None = None,
                 runner: TargetRunner | None = None) -> bytes:
        """Server-only generation; `emit` gets each new piece of text and its token ids; `copy_tokens` the longest
        copy chain verified (default: the engine's); `runner` a cache holding a prefix of `prompt` to continue
        (`SpeculativeEngine.generate`). Returns the `done` frame."""
        t0 = time.perf_counter()
        result = self.engine(drafter).generate(prompt, max_new_tokens, sampling.temperature, sampling.top_p,
                                               sampling.top_k, token_streamer=emit, seed=seed, copy_tokens=copy_tokens,
                                               runner=runner)
        self.metrics.target_seconds += time.perf_counter() - t0
        return P.encode(P.DONE, {"tokens": result.token_ids, "text": result.text, "finish_reason": result.finish_reason,
                                 "stats": result.stats.as_dict()})


def _slice(step: TargetStep, n: int, start: int = 0) -> TargetStep:
    return TargetStep(step.logits[start:n], step.hidden[start:n], step.keys[:, start:n], step.values[:, start:n])


@dataclass
class Session:
    """One edge transcript: the committed tokens, the target cache over them and the pending next token."""

    id: str
    owner: str
    row_dtype: str
    model: Model
    runner: TargetRunner | None = None
    tokens: list[int] = field(default_factory=list)
    next_token: int | None = None  # the root of the next tree (not committed)
    last_seq: int = -1
    last_reply: bytes | None = None
    last_type: str | None = None  # the reply type of last_seq's request (prefilled | verified)
    last_used: float = field(default_factory=time.monotonic)
    connections: int = 0  # open connections that used this session
    lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)  # one operation at a time (server.app)
    generator: torch.Generator = field(init=False)

    def __post_init__(self) -> None:
        self.generator = torch.Generator(device=self.model.target.device).manual_seed(secrets.randbits(63))

    @property
    def used(self) -> bool:
        return self.runner is not None

    def starts(self, prompt: list[int]) -> bool:
        """Whether the committed transcript, with its cache, is a prefix of `prompt`."""
        n = len(self.tokens)
        return self.runner is not None and 0 < n <= len(prompt) and self.tokens == prompt[:n]

    def recover(self) -> None:
        """After an operation failed half-way: the target cache back to the committed transcript (a pending next
        token that may no longer fit it was already dropped), so the session serves its next request."""
        if self.runner is not None:
            self.runner.crop(len(self.tokens))

    def _repeat(self, seq: int, reply_type: str) -> bytes | None:
        """The cached reply for a retried `seq`; None for a new one; bad_request for an older one or for a retry
        that is another kind of request."""
        if seq == self.last_seq and self.last_reply is not None:
            if self.last_type != reply_type:
                raise P.ProtocolError(f"seq {seq} was already used by a request answered with {self.last_type}: a "
                                      "new request needs a higher seq", P.E_BAD_REQUEST)
            return self.last_reply
        if seq <= self.last_seq:
            raise P.ProtocolError(f"stale seq {seq}: this session already processed seq {self.last_seq}",
                                  P.E_BAD_REQUEST)
        return None

    def _check_context(self, length: int) -> None:
        if length > self.model.limits.max_context:
            raise P.ProtocolError(f"context of {length} tokens is over max_context={self.model.limits.max_context}",
                                  P.E_LIMIT)

    def _reply(self, msg_type: str, fields: dict[str, Any], rows: np.ndarray, timings: tuple[float, float],
               seq: int | None = None) -> bytes:
        """The reply frame, with the target's and the memory rows' seconds (counted in the metrics too)."""
        target_s, rows_s = timings
        self.model.metrics.target_seconds += target_s + rows_s
        frame = P.encode(msg_type, {**fields, "length": len(self.tokens), "timings": {"target_s": target_s,
                                                                                     "rows_s": rows_s}},
                         P.encode_rows(rows, self.row_dtype))
        if seq is not None:
            self.last_seq, self.last_reply, self.last_type = seq, frame, msg_type
        return frame

    def _commit(self, tokens: list[int], step: TargetStep, next_token: int,
                pause: Callable[[], None] = no_pause) -> tuple[np.ndarray, float]:
        """Append verified tokens (their target activations in `step`); return their memory rows and the time."""
        t = time.perf_counter()
        rows = self.model.rows(step, len(self.tokens), pause)
        self.tokens.extend(tokens)
        self.next_token = next_token
        self.model.metrics.committed_tokens += len(tokens)
        return rows, time.perf_counter() - t

    def prefill(self, seq: int, tokens: list[int], sampling: Sampling, pause: Callable[[], None] = no_pause) -> bytes:
        """Replace the transcript with `tokens`: target forward, memory rows of all of them, first next token.
        Nothing changes until all of it is computed."""
        self.model.require_memory_head()
        if (cached := self._repeat(seq, P.PREFILLED)) is not None:
            return cached
        self._check_context(len(tokens))
        t = time.perf_counter()
        runner = self.model.new_runner()
        step = forward_chunked(runner, tokens, self.model.limits.prefill_chunk, pause, logits="last")
        next_token = sample_token(step.logits[-1], sampling, self.generator)
        target_s = time.perf_counter() - t
        t = time.perf_counter()
        rows = self.model.rows(step, 0, pause)
        rows_s = time.perf_counter() - t
        self.runner, self.tokens, self.next_token = runner, list(tokens), next_token
        self.model.metrics.committed_tokens += len(tokens)
        return self._reply(P.PREFILLED, {"seq": seq, "next_token": next_token}, rows, (target_s, rows_s), seq)

    def verify(self, seq: int, root: int, tree: DraftTree, sampling: Sampling) -> bytes:
        """Verify root + tree against the target, keep the accepted path, return its memory rows."""
        self.model.require_memory_head()
        if (cached := self._repeat(seq, P.VERIFIED)) is not None:
            return cached
        if self.next_token is None:
            raise P.ProtocolError("verify before prefill: send prefill first", P.E_BAD_REQUEST)
        if root != self.next_token:
            raise P.ProtocolError(f"tokens[0] = {root} is not the pending next token {self.next_token}", P.E_BAD_TREE)
        self._check_context(len(self.tokens) + 1 + len(tree))
        t = time.perf_counter()
        verified = verify_tree(self.runner, root, tree, sampling, self.generator)
        target_s = time.perf_counter() - t
        rows, rows_s = self._commit([root] + verified.accepted, verified.step, verified.next_token)
        self.model.metrics.accepted_tokens += len(verified.path)
        self.model.metrics.verified(len(tree), len(verified.path))
        return self._reply(P.VERIFIED, {"seq": seq, "accepted": P.encode_accepted(verified.path),
                                        "next_token": verified.next_token}, rows, (target_s, rows_s), seq)

    def resume(self, length: int, tokens: list[int], policy: str, sampling: Sampling,
               pause: Callable[[], None] = no_pause) -> bytes:
        """Continue at the client's committed `length` with its offline `tokens` (root first).

        keep: all of them become verified; verify: only the prefix the greedy target agrees with.
        """
        self.model.require_memory_head()
        if self.runner is None or length > len(self.tokens):
            raise P.ProtocolError(f"session {self.id} has {len(self.tokens)} committed tokens, cannot resume at "
                                  f"length {length}: prefill the whole transcript", P.E_UNKNOWN_SESSION)
        self._check_context(length + len(tokens))
        t = time.perf_counter()
        self.runner.crop(length)
        del self.tokens[length:]
        self.next_token = None  # until this resume is done: a failure half-way leaves no stale root
        self.last_reply = None  # a retry of an earlier seq must not replay a reply from before the rewind
        step = forward_chunked(self.runner, tokens, self.model.limits.prefill_chunk, pause)
        upto = len(tokens)
        if policy == "verify":
            disagree = np.flatnonzero(step.logits[:-1].argmax(-1).cpu().numpy() != np.asarray(tokens[1:]))
            upto = 1 + int(disagree[0]) if len(disagree) else upto
            self.runner.crop(length + upto)
        next_token = sample_token(step.logits[upto - 1], sampling, self.generator)
        target_s = time.perf_counter() - t
        rows, rows_s = self._commit(tokens[:upto], _slice(step, upto), next_token, pause)
        return self._reply(P.RESUMED, {"accepted_upto": upto, "next_token": next_token}, rows, (target_s, rows_s))
