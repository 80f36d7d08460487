"""EAGLE-2 dynamic draft trees, in numpy so that the PyTorch engine and the ONNX Runtime edge build the very
same tree from the same drafter outputs (docs/design.md §5).

From the root (the target's next token) the tree grows `depth` times: the `topk` frontier nodes with the best
cumulative log-probability are run through the drafter in one call, each proposes `topk` children; at the end
all nodes are reranked and the best `total_tokens` kept (a child never scores above its parent, so the kept
set is a subtree). Greedy decoding takes each node's top-k children; sampling draws them without replacement
from the drafter's (top-K truncated) distribution q, and the verifier needs q: `DraftTree.q_ids/q_probs`.
`graft` adds a copy chain (prompt lookup's proposal) below the root; `DraftTree.sources` tells the verifier which
nodes were drawn from q and which are on the chain.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

ROOT = -1
NEG_INF = np.float32(-np.inf)
DRAFTED, COPIED = 1, 2  # DraftTree.sources flags: drawn from the parent's q; on the copy chain (a node can be both)


@dataclass(frozen=True)
class TreeConfig:
    depth: int = 5
    topk: int = 4
    total_tokens: int = 24

    def __post_init__(self):
        if self.depth < 0 or self.topk < 1 or self.total_tokens < 0:
            raise ValueError(f"bad tree budget {self}")

    @classmethod
    def parse(cls, text: str) -> "TreeConfig":
        """'depth,topk,total' (a chain is 'd,1,d')."""
        try:
            depth, topk, total = (int(x) for x in text.split(","))
        except ValueError:
            raise ValueError(f"--tree takes 'auto' or 'depth,topk,total_tokens', got {text!r}") from None
        return cls(depth, topk, total)

    def __str__(self) -> str:
        return f"{self.depth},{self.topk},{self.total_tokens}"


@dataclass
class DraftTree:
    """The nodes below the root, parents first. parents[i] == -1 means the root."""

    tokens: np.ndarray  # int64 (n,)
    parents: np.ndarray  # int64 (n,)
    depths: np.ndarray  # int64 (n,), 1 for the root's children
    q_ids: np.ndarray  # int64 (n+1, K): candidates of the draft distribution at the root (row 0) and each node
    q_probs: np.ndarray  # float32 (n+1, K): q over those candidates (renormalised), 0 where unused
    origin: np.ndarray | None = None  # int64 (n,): each node's index in the drafting pool (drafter cache slots)
    sources: np.ndarray | None = None  # uint8 (n,): DRAFTED | COPIED flags (`check_sources`); None: all DRAFTED

    def __len__(self) -> int:
        return len(self.tokens)

    def children(self, node: int) -> list[int]:
        """Children of `node` (-1 = root) in the order they were drawn."""
        return [i for i, p in enumerate(self.parents) if p == node]

    def drawn_children(self, node: int) -> list[int]:
        """The children of `node` drawn from its draft distribution q, in the order they were drawn."""
        return [i for i in self.children(node) if self.sources is None or self.sources[i] & DRAFTED]

    def copied_child(self, node: int) -> int | None:
        """The child of `node` on the copy chain, if any."""
        if self.sources is None:
            return None
        return next((i for i in self.children(node) if self.sources[i] & COPIED), None)


def check_sources(parents: np.ndarray, sources: np.ndarray) -> None:
    """Raise ValueError unless `sources` flags every node DRAFTED, COPIED or both, and the COPIED nodes form one
    path down from the root."""
    if sources.shape != parents.shape:
        raise ValueError(f"sources {list(sources.shape)} must be [{len(parents)}], one flag set per node")
    if ((sources == 0) | (sources > (DRAFTED | COPIED))).any():
        raise ValueError(f"sources must be {DRAFTED} (drafted), {COPIED} (copied) or {DRAFTED | COPIED} (both)")
    chain = np.flatnonzero(sources & COPIED)
    if len(chain) and not (parents[chain] == np.concatenate([[ROOT], chain[:-1]])).all():
        raise ValueError("the copied nodes must form one path down from the root")


class Expand(Protocol):
    def __call__(self, nodes: list[int], tokens: list[int], parents: list[int], depths: list[int]) -> tuple[
        np.ndarray, np.ndarray]:
        """Run the drafter on pool `nodes` (ROOT for the root); return top-K ids and log-probs per node."""


def gumbel_order(logq: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """k indices drawn without replacement from softmax(logq) (Gumbel-top-k)."""
    keys = logq + rng.gumbel(size=logq.shape).astype(np.float32)
    return np.argsort(-keys, kind="stable")[:k]


def build_tree(expand: Expand, cfg: TreeConfig, sample: bool = False,
               rng: np.random.Generator | None = None) -> DraftTree:
    """Grow the tree by calling `expand` depth times; see the module docstring."""
    tokens: list[int] = []
    parents: list[int] = []
    depths: list[int] = []
    scores: list[float] = []
    cand: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # node -> (ids, log q) it was expanded with
    frontier = [ROOT]
    frontier_scores = [0.0]
    for depth in range(1, cfg.depth + 1):
        ids, logq = expand(frontier, tokens, parents, depths)
        proposals = []  # (score, parent, token)
        for row, node in enumerate(frontier):
            cand[node] = (ids[row], logq[row])
            valid = np.isfinite(logq[row])
            k = min(cfg.topk, int(valid.sum()))
            if sample:
                order = gumbel_order(np.where(valid, logq[row], NEG_INF), k, rng)
            else:
                order = np.argsort(-logq[row], kind="stable")[:k]
            last = np.inf
            for j in order:
                # scores never rise along a sibling order, so any rerank keeps a prefix of the drawn children
                last = min(last, frontier_scores[row] + float(logq[row][j]))
                proposals.append((last, node, int(ids[row][j])))
        first_new = len(tokens)
        for score, parent, token in proposals:
            tokens.append(token)
            parents.append(parent)
            depths.append(depth)
            scores.append(score)
        if depth == cfg.depth:
            break
        new = range(first_new, len(tokens))
        best = sorted(new, key=lambda i: -scores[i])[: cfg.topk]
        frontier = sorted(best)
        frontier_scores = [scores[i] for i in frontier]
    keep = sorted(sorted(range(len(tokens)), key=lambda i: -scores[i])[: cfg.total_tokens])
    return _subtree(keep, tokens, parents, depths, cand)


def _subtree(keep, tokens, parents, depths, cand) -> DraftTree:
    index = {old: new for new, old in enumerate(keep)}
    index[ROOT] = ROOT
    width = max((len(c[0]) for c in cand.values()), default=1)
    q_ids = np.zeros((len(keep) + 1, width), dtype=np.int64)
    q_probs = np.zeros((len(keep) + 1, width), dtype=np.float32)
    for old in [ROOT] + keep:
        if old in cand:
            ids, logq = cand[old]
            p = np.exp(logq - logq.max())
            row = index[old] + 1
            q_ids[row, : len(ids)] = ids
            q_probs[row, : len(ids)] = p / p.sum()
    return DraftTree(
        tokens=np.array([tokens[i] for i in keep], dtype=np.int64),
        parents=np.array([index[parents[i]] for i in keep], dtype=np.int64),
        depths=np.array([depths[i] for i in keep], dtype=np.int64),
        q_ids=q_ids,
        q_probs=q_probs,
        origin=np.array(keep, dtype=np.int64),
    )


def graft(tree: DraftTree, chain: list[int]) -> DraftTree:
    """The drafted `tree` (`build_tree`'s, with its origin) with the token chain `chain` below the root: the chain
    follows the tree's nodes as far as their tokens match and continues as new nodes from there. A new node has
    no draft distribution (its q row stays 0) and no drafter cache slot (origin -1); `sources` marks the chain, so
    that sampling tries it as a one-hot proposal before the drawn children (models.verify.accept_sampling)."""
    tokens, parents, depths = tree.tokens.tolist(), tree.parents.tolist(), tree.depths.tolist()
    node, added = ROOT, 0
    sources = np.full(len(tokens), DRAFTED, dtype=np.uint8)
    for token in chain:
        child = next((i for i, (t, p) in enumerate(zip(tokens, parents)) if p == node and t == token), None)
        if child is None:
            tokens.append(token)
            parents.append(node)
            depths.append(depths[node] + 1 if node != ROOT else 1)
            child, added = len(tokens) - 1, added + 1
            sources = np.append(sources, np.uint8(0))
        sources[child] |= COPIED
        node = child
    pad = np.zeros((added, tree.q_ids.shape[1]), dtype=np.int64)
    return DraftTree(
        tokens=np.array(tokens, dtype=np.int64),
        parents=np.array(parents, dtype=np.int64),
        depths=np.array(depths, dtype=np.int64),
        q_ids=np.concatenate([tree.q_ids, pad]),
        q_probs=np.concatenate([tree.q_probs, pad.astype(np.float32)]),
        origin=np.concatenate([tree.origin, np.full(added, -1, dtype=np.int64)]),
        sources=sources,
    )


def ancestor_matrix(parents: np.ndarray) -> np.ndarray:
    """bool (n, n): [i, j] is True when j is i itself or an ancestor of i (parents precede children)."""
    n = len(parents)
    vis = np.zeros((n, n), dtype=bool)
    for i, p in enumerate(parents):
        if p >= i:
            raise ValueError(f"node {i} has parent {p}: a parent must precede its child")
        if p >= 0:
            vis[i] = vis[p]
        vis[i, i] = True
    return vis


def topk_logprobs(logits: np.ndarray, k: int, temperature: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """(m, V) logits -> top-k ids and log-probs (full-softmax normalised, at `temperature`; 0 counts as 1) per row,
    best first."""
    x = logits.astype(np.float64) / max(temperature if temperature > 0 else 1.0, 1e-6)
    x = x - x.max(-1, keepdims=True)
    logp = (x - np.log(np.exp(x).sum(-1, keepdims=True))).astype(np.float32)
    k = min(k, logp.shape[-1])
    ids = np.argpartition(-logp, k - 1, axis=-1)[:, :k]
    vals = np.take_along_axis(logp, ids, -1)
    order = np.argsort(-vals, axis=-1, kind="stable")
    return np.take_along_axis(ids, order, -1).astype(np.int64), np.take_along_axis(vals, order, -1)
