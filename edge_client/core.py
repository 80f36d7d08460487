"""The edge's speculative session without I/O: transcript, state and protocol, as websockets splits its protocol
from its I/O (docs/design.md §6-7).

`EdgeCore` owns what the edge knows of a generation: the committed tokens and their memory rows, the pending root
(the server's next token), the offline tail, the request `seq` and an explicit `State`. It builds the requests
(`sync_request`, `verify_request`) as frames and takes their replies (`on_reply`), checking each reply against the
request before it changes anything. It never touches a socket or a clock: `edge_client.client` sends the frames,
reconnects and times them, and tests drive it with any transport.

A generation: `start(prompt)`, then `begin_sync` and one `sync_request` / `on_reply` exchange after the other until
the state is ONLINE (normally one `resume`, or a `prefill` when the server lacks the prompt or lost the session,
then a `resume` of the edge's own continuation), then verify rounds. When the link fails the driver calls
`go_offline` and makes tokens with `offline_token`; back online it syncs again and the server keeps or checks them
(policy `keep` or `verify`, which rewinds to the first disagreement).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any

import numpy as np

from moa_core import protocol as P
from moa_core.drafting import DraftSession, DraftStep, OfflineGuard
from moa_core.lookup import copy_chain
from moa_core.tree import DraftTree, TreeConfig

log = logging.getLogger("moa.edge")

POLICIES = ("keep", "verify")


class EdgeError(RuntimeError):
    """The client cannot go on; the message says why."""


class State(Enum):
    ONLINE = "online"  # the server holds the committed transcript: verify rounds
    OFFLINE = "offline"  # no usable server: the drafter generates alone, memory frozen
    RESYNCING = "resyncing"  # bringing the server up to the edge's transcript (sync_request / on_reply)


@dataclass
class Stats:
    """Figures of one generation. Bytes count the frames of generation requests and replies (not the handshake)."""

    mode: str
    tree: str = ""
    new_tokens: int = 0
    server_calls: int = 0  # requests sent: prefill, verify, resume, generate (retries included)
    verify_calls: int = 0
    accepted_tokens: int = 0  # tokens gained by verify calls, the root included: tau = accepted / verify calls
    copy_rounds: int = 0  # verify calls (or the server's rounds, in api mode) with a copy chain
    handover_tokens: int = 0  # tokens the server generated alone after speculation was handed over mid-reply
    offline_tokens: int = 0  # tokens the drafter made alone while offline
    rewound_tokens: int = 0  # offline tokens shown, then withdrawn by a `verify` resume
    reconnects: int = 0
    retries: int = 0  # requests sent again (same seq) on a reopened connection
    bytes_up: int = 0
    bytes_down: int = 0
    network_wait_s: float = 0.0  # time blocked on the server: round trips, server compute included
    server_s: float = 0.0  # the server's own compute time, as its replies report it
    draft_s: float = 0.0
    total_s: float = 0.0
    predicted_s: float | None = None  # what the forecast predicted before the generation (for its new_tokens)

    @property
    def tau(self) -> float:
        return self.accepted_tokens / self.verify_calls if self.verify_calls else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s else 0.0

    def as_dict(self) -> dict[str, Any]:
        per_token = (self.bytes_up + self.bytes_down) / self.new_tokens if self.new_tokens else 0.0
        return {**asdict(self), "tau": self.tau, "tokens_per_s": self.tokens_per_s, "bytes_per_token": per_token}


@dataclass(frozen=True)
class Request:
    """A request frame, the reply type it expects and what its reply is checked against. A retry sends the very
    same frame (same seq)."""

    type: str
    frame: bytes
    reply: str
    seq: int | None = None  # prefill and verify replies echo it
    tokens: tuple[int, ...] = ()  # prefill: the given tokens; resume: the tokens after `length`
    tree: DraftTree | None = None  # verify: the drafted tree below the pending root
    session_id: str | None = None  # the session it goes to


def common_prefix(a: list | str, b: list | str) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def token_tensor(tokens: list[int] | tuple[int, ...]) -> dict[str, np.ndarray]:
    return {"tokens": np.asarray(tokens, np.int32)}


class EdgeCore:
    """One edge session's transcript and protocol state, no I/O.

    tokens[:length] are committed on the server (rows[i] is token i's memory row); tokens[length] is the pending
    root (the server's next token) once synced, and whatever the drafter made offline follows it."""

    def __init__(self, step: DraftStep, row_width: int, tree: TreeConfig, policy: str = "keep",
                 session_id: str | None = None, seq: int = 0, copy_tokens: int = 0):
        """`policy` (one of POLICIES): what a resume does with offline tokens; `seq` the last one used;
        `copy_tokens`: trees also verify up to that many tokens copied from where the transcript's last tokens
        occurred before (`moa_core.lookup.copy_chain`)."""
        self.step, self.row_width, self.tree, self.policy = step, row_width, tree, policy
        self.copy_tokens = copy_tokens
        self.session_id, self.seq = session_id, seq
        self.state = State.OFFLINE
        self.stats = Stats("speculative")
        self.sampling: dict[str, Any] = {"temperature": 0.0, "top_p": 1.0, "top_k": 0}
        self.prompt: list[int] = []
        self.tokens: list[int] = []
        self.length = 0
        self.rows = np.zeros((0, row_width), np.float32)
        self.pending: int | None = None  # the server's next token after tokens[:length] (this generation)
        self.kept_unchecked = 0  # offline tokens of this generation the server took under `keep`
        self.alone = 0  # tokens after the pending root that the server generated alone (handed over), uncommitted
        self._draft: DraftSession | None = None  # drafts trees over the committed transcript
        self._offline: DraftSession | None = None  # generates alone while offline
        self._sent: Request | None = None  # the outstanding request
        self._link_session: str | None = None  # the session a prefill goes to (the current connection's)
        self._lost = False  # this sync re-feeds the whole transcript (the server lost the session)
        self._prefilled = False  # this sync has sent a prefill

    # ---- a generation -----------------------------------------------------------------------------------------
    def start(self, prompt: list[int], sampling: dict[str, Any], stats: Stats) -> None:
        """A new generation of `prompt`: keep the memory rows of what the server committed of it, drop the rest."""
        self.length = common_prefix(self.tokens[:self.length], prompt)
        self.prompt, self.tokens, self.rows = list(prompt), list(prompt), self.rows[:self.length]
        self.sampling, self.stats = dict(sampling), stats
        self.pending, self._draft, self._offline, self._sent = None, None, None, None
        self.kept_unchecked = self.alone = 0

    @property
    def generated(self) -> list[int]:
        return self.tokens[len(self.prompt):]

    def unverified(self, n_out: int) -> int:
        """How many of the first `n_out` generated tokens the target never checked: those kept under `keep` and
        those after the committed transcript, its pending next token and what the server generated alone after it."""
        root = int(self.length < len(self.tokens) and self.tokens[self.length] == self.pending)
        first = max(len(self.prompt), self.length + root + self.alone)
        return self.kept_unchecked + max(0, min(len(self.tokens), len(self.prompt) + n_out) - first)

    # ---- sync: resume, or prefill (+ resume) ------------------------------------------------------------------
    def begin_sync(self, link_session: str, lost: bool = False) -> None:
        """Bring the server up to the edge's transcript over a connection whose own session is `link_session`.
        `lost`: the server lost the session, re-feed the transcript to `link_session`."""
        if lost:
            log.info("the server lost session %s: prefilling the transcript in a new one", self.session_id)
        self.state, self._link_session, self._sent = State.RESYNCING, link_session, None
        self._lost, self._prefilled = lost, False

    @property
    def prefilled(self) -> bool:
        """This sync has sent a prefill: a session lost after it is not the edge's to repair."""
        return self._prefilled

    def sync_request(self) -> Request:
        """The next request of the sync: a `resume` of the tokens after `length` (the pending root and what was made
        offline) under the policy, or, when the server lacks the prompt (new generation) or the session (`lost`),
        a `prefill` of the tokens it must take as given."""
        assert self.state is State.RESYNCING and self._sent is None
        if not self._lost and len(self.prompt) <= self.length < len(self.tokens):
            sent = tuple(self.tokens[self.length:])
            return self._send(P.RESUME, {"length": self.length, "policy": self.policy, **self.sampling},
                              token_tensor(sent), P.RESUMED, tokens=sent)
        given = tuple(self.tokens[:max(self.length, len(self.prompt))])
        self._prefilled = True
        self.seq += 1
        return self._send(P.PREFILL, {"seq": self.seq, **self.sampling}, token_tensor(given), P.PREFILLED,
                          seq=self.seq, tokens=given, session_id=self._link_session)

    def _send(self, msg_type: str, fields: dict[str, Any], tensors: dict[str, np.ndarray], reply: str,
              session_id: str | None = None, **checks: Any) -> Request:
        """The request (to this core's session unless `session_id` says otherwise); it is now outstanding."""
        session_id = session_id or self.session_id
        frame = P.encode(msg_type, {"session_id": session_id, **fields}, tensors)
        self._sent = Request(msg_type, frame, reply, session_id=session_id, **checks)
        return self._sent

    # ---- verify rounds ----------------------------------------------------------------------------------------
    def verify_request(self, rng: np.random.Generator | None = None) -> Request:
        """Draft a tree below the pending root and ask the server to verify it (the seq is used up)."""
        assert self.state is State.ONLINE and self._sent is None
        root = self.tokens[-1]
        copy = copy_chain(self.tokens, self.copy_tokens)
        tree = self._draft.draft(root, self.tree, self.sampling["temperature"], rng, copy)
        self.seq += 1
        tensors = P.encode_tree(root, tree, with_q=self.sampling["temperature"] > 0)
        return self._send(P.VERIFY, {"seq": self.seq, **self.sampling}, tensors, P.VERIFIED, seq=self.seq, tree=tree)

    # ---- replies ----------------------------------------------------------------------------------------------
    def on_reply(self, msg: P.Message) -> list[int]:
        """Take the reply to the outstanding request (validated by P.validate); the tokens it committed.
        A reply that does not fit the request raises EdgeError and changes nothing."""
        sent = self._sent
        if sent is None or msg.type != sent.reply:
            raise EdgeError(f"expected a {sent.reply if sent else 'no'} reply, the server sent {msg.type}")
        if sent.seq is not None and msg.fields["seq"] != sent.seq:
            raise EdgeError(f"a reply to seq {msg.fields['seq']} for the request of seq {sent.seq}")
        if msg.type == P.VERIFIED:
            new = self._check(msg, 0, [self.tokens[-1]] + self._path_tokens(sent.tree, msg.fields["accepted"]))
            path = P.decode_accepted(msg.fields["accepted"])
            rows = P.decode_rows(msg.tensors)
            self._draft.accept(sent.tree, new[0], path, rows)
            self._commit(new, rows, msg)
            self.stats.verify_calls += 1
            self.stats.accepted_tokens += len(new)
            self.stats.copy_rounds += sent.tree.sources is not None
            return new
        if msg.type == P.PREFILLED:
            new = self._check(msg, -self.length, list(sent.tokens))
            self.session_id, self.length, self.rows = sent.session_id, 0, self.rows[:0]
            tail = self.tokens[len(new):]
            self._commit(new, P.decode_rows(msg.tensors), msg)
            if tail and self.policy == "verify" and tail[0] != self.pending:  # resume checks all but the first
                self.stats.rewound_tokens += len(tail)
                log.info("resumed (verify): the target's first token differs, rewound %d offline tokens", len(tail))
                tail = []
            if tail:  # the edge's own continuation stands: restore it; the next sync request resumes it
                self.tokens[len(new):] = tail
                self._lost = False
                return new
        else:  # RESUMED
            kept = msg.fields["accepted_upto"]
            if not 1 <= kept <= len(sent.tokens):
                raise EdgeError(f"the server kept {kept} of {len(sent.tokens)} resumed tokens")
            new = self._check(msg, 0, list(sent.tokens[:kept]))
            if self.policy == "keep":  # all but the server's own tokens: its next token and those it made alone
                root = int(sent.tokens[0] == self.pending)
                self.kept_unchecked += kept - root - min(self.alone, kept - root)
            self._commit(new, P.decode_rows(msg.tensors), msg)
            self.stats.rewound_tokens += len(sent.tokens) - kept
            if len(sent.tokens) > 1:
                log.info("resumed (%s): the server kept %d of %d offline tokens%s", self.policy, kept, len(sent.tokens),
                         f", rewound {len(sent.tokens) - kept}" if kept < len(sent.tokens) else "")
        self._synced()
        return new

    def _path_tokens(self, tree: DraftTree, accepted: list[int]) -> list[int]:
        """The tokens of the accepted path below the root, checked to be a path of `tree` from the root."""
        if not accepted or accepted[0] != 0:
            raise EdgeError(f"accepted path {accepted} does not start at the root")
        path, parent = P.decode_accepted(accepted), -1
        for node in path:
            if not 0 <= node < len(tree) or tree.parents[node] != parent:
                raise EdgeError(f"accepted path {accepted} is not a path of the drafted tree")
            parent = node
        return [int(tree.tokens[i]) for i in path]

    def _check(self, msg: P.Message, shift: int, new: list[int]) -> list[int]:
        """`new` tokens become committed after `length` + `shift`: the reply must have their rows and that length."""
        n_rows = len(msg.tensors["rows"])
        length = self.length + shift + len(new)
        if msg.fields["length"] != length or n_rows != len(new):
            raise EdgeError(f"the server's transcript ({msg.fields['length']} tokens, {n_rows} new rows) "
                            f"disagrees with the edge's ({length}, {len(new)})")
        return new

    def _commit(self, new: list[int], rows: np.ndarray, msg: P.Message) -> None:
        """`new` tokens are verified after `length` with their `rows`; the reply's next token follows them."""
        self._sent = None
        self.tokens[self.length:] = new
        self.rows = np.concatenate([self.rows, rows])
        self.length += len(new)
        self.pending = int(msg.fields["next_token"])
        self.tokens.append(self.pending)

    def _synced(self) -> None:
        """The server holds the edge's transcript: draft from the committed tokens again."""
        self._draft = DraftSession(self.step)
        self._draft.add_verified(self.tokens[:self.length], self.rows)
        self._offline, self._lost, self._prefilled = None, False, False
        self.alone = 0  # committed now, or rewound
        self.state = State.ONLINE

    # ---- the server alone ------------------------------------------------------------------------------------
    def take_alone(self, tokens: list[int]) -> None:
        """Tokens the server generated alone after the pending root (speculation handed over mid-reply): the target's
        own, joining the transcript uncommitted, like offline tokens, so that a later sync resumes them."""
        assert self.state is State.ONLINE and self.alone == len(self.tokens) - self.length - 1
        self.tokens.extend(tokens)
        self.alone += len(tokens)
        self.stats.handover_tokens += len(tokens)

    # ---- offline ----------------------------------------------------------------------------------------------
    def go_offline(self) -> None:
        """The link is gone: generate alone from now on (an unanswered request is dropped)."""
        self.state, self._sent = State.OFFLINE, None

    def offline_token(self, temperature: float, rng: np.random.Generator | None,
                      guard: OfflineGuard | None) -> int:
        """One token from the drafter alone, memory frozen at the last verified token; it joins the transcript."""
        assert self.state is State.OFFLINE
        if self._offline is None:
            self._offline = self._offline_drafter()
        token = self._offline.next_token(self.tokens[-1], temperature, rng, guard)
        self.tokens.append(token)
        self.stats.offline_tokens += 1
        return token

    def _offline_drafter(self) -> DraftSession:
        """A drafter over the transcript but its last token: committed tokens with their memory rows, later ones
        (a new prompt's turn) fed with the memory frozen. Never synced (offline mode): no memory (zero rows)."""
        drafter = DraftSession(self.step)
        if self.length:
            drafter.add_verified(self.tokens[:self.length], self.rows)
            for token in self.tokens[self.length:-1]:
                drafter.next_token(token)
        else:
            drafter.add_verified(self.tokens[:-1], np.zeros((len(self.tokens) - 1, self.row_width), np.float32))
        return drafter
