"""Tree verification on the target: the half of speculative decoding the server reuses as is (docs/design.md §5).

One target forward over root + tree nodes (float tree mask, position = context length + depth). Greedy: the
longest path whose every node is the target's argmax at its parent; the argmax after its last node is the next
root. Sampling: multi-draft rejection sampling down the tree with the drafter's q (children were drawn without
replacement from q): try children in order, accept x with probability min(1, p(x)/q(x)); on rejection
p <- norm(max(p - q, 0)) and x leaves q; if no child is accepted, the next token is drawn from what is left of p.
Either walk reads the target's logits at the root and the nodes it accepts; the LM head runs once over every row,
since one matrix product over all of them costs about two over one row (on this CPU 17 ms for 17 rows, 8.3 for 1,
and the walk reads about three once drafters agree), and the cost model's verify rounds then include all of it.
Afterwards the target cache keeps only the accepted path.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from moa_core.tree import DraftTree, ancestor_matrix
from models.target import TargetRunner, TargetStep


@dataclass(frozen=True)
class Sampling:
    """Hugging Face-style decoding settings; temperature 0 means greedy."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


@dataclass
class Verified:
    path: list[int]  # accepted tree nodes, root excluded
    accepted: list[int]  # their tokens
    next_token: int  # the target's token after the accepted path (the next root)
    step: TargetStep  # target activations of root + accepted nodes (the newly verified tokens)


def target_probs(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """The target distribution p after temperature / top-k / top-p, float64 on the last axis."""
    x = logits.double() / s.temperature
    if s.top_k and s.top_k < x.shape[-1]:
        kth = torch.topk(x, s.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    p = torch.softmax(x, dim=-1)
    if s.top_p < 1.0:
        sp, order = torch.sort(p, dim=-1, descending=True)
        drop = (sp.cumsum(-1) - sp) >= s.top_p
        p = p.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), 0.0)
        p = p / p.sum(-1, keepdim=True)
    return p


def tree_mask_and_positions(tree: DraftTree, base: int, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask (1+n, 1+n) over root + nodes (each sees root, its ancestors, itself) and their positions."""
    n = len(tree)
    vis = np.ones((n + 1, n + 1), dtype=bool)
    vis[0, 1:] = False
    vis[1:, 1:] = ancestor_matrix(tree.parents)
    mask = torch.zeros(n + 1, n + 1, dtype=dtype, device=device)
    mask.masked_fill_(torch.from_numpy(~vis).to(device), float("-inf"))
    positions = base + torch.from_numpy(np.concatenate([[0], tree.depths])).to(device)
    return mask, positions


def accept_greedy(logits: torch.Tensor, tree: DraftTree) -> tuple[list[int], int]:
    node, path = -1, []
    while True:
        nxt = int(logits[node + 1].argmax())
        child = next((c for c in tree.children(node) if int(tree.tokens[c]) == nxt), None)
        if child is None:
            return path, nxt
        path.append(child)
        node = child


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The target distribution left after a draft from q was rejected: norm(max(p - q, 0)), or p if that is 0."""
    r = torch.clamp(p - q, min=0)
    return r / r.sum() if r.sum() > 0 else p


def accept_sampling(logits: torch.Tensor, tree: DraftTree, s: Sampling, g: torch.Generator) -> tuple[list[int], int]:
    """Multi-draft rejection sampling down the tree (docs/design.md §5). A copied child (`tree.sources`) is tried
    first, as a proposal from a one-hot q: accepted with probability p(x), else p loses x; then the children drawn
    from q, each stage taking the target distribution the one before left, so the token keeps p exactly."""
    node, path = -1, []
    while True:
        p = target_probs(logits[node + 1], s)
        copied = tree.copied_child(node)
        if copied is not None:
            x = int(tree.tokens[copied])
            if torch.rand((), generator=g, dtype=torch.float64) < p[x]:
                path.append(copied)
                node = copied
                continue
            p = residual(p, torch.nn.functional.one_hot(torch.tensor(x), len(p)).to(p))
        q = torch.zeros_like(p)
        q.index_add_(0, torch.from_numpy(tree.q_ids[node + 1]).to(p.device),
                     torch.from_numpy(tree.q_probs[node + 1]).to(p))
        accepted = None
        for c in tree.drawn_children(node):
            x = int(tree.tokens[c])
            if q[x] > 0 and torch.rand((), generator=g, dtype=torch.float64) < torch.clamp(p[x] / q[x], max=1.0):
                accepted = c
                break
            p = residual(p, q)
            q[x] = 0
            if q.sum() > 0:
                q = q / q.sum()
        if accepted is None:
            return path, int(torch.multinomial(p, 1, generator=g))
        path.append(accepted)
        node = accepted


def verify_tree(runner: TargetRunner, root: int, tree: DraftTree, sampling: Sampling = Sampling(),
                generator: torch.Generator | None = None) -> Verified:
    """Run the target over root + tree, accept a path, keep only it in the cache."""
    base = runner.length
    mask, positions = tree_mask_and_positions(tree, base, runner.target.dtype, runner.target.device)
    tokens = [root] + tree.tokens.tolist()
    step = runner.forward(tokens, positions, mask)  # logits (1 + n, V): row 0 the root, i + 1 node i
    if sampling.greedy:
        path, nxt = accept_greedy(step.logits, tree)
    else:
        path, nxt = accept_sampling(step.logits, tree, sampling, generator)
    rows = [0] + [i + 1 for i in path]
    runner.keep_path(len(tokens), rows)
    kept = TargetStep(step.logits[rows], step.hidden[rows], step.keys[:, rows], step.values[:, rows])
    return Verified(path, [int(tree.tokens[i]) for i in path], nxt, kept)


def sample_token(logits: torch.Tensor, s: Sampling, g: torch.Generator | None) -> int:
    """The target's next token from one row of logits."""
    if s.greedy:
        return int(logits.argmax())
    return int(torch.multinomial(target_probs(logits, s), 1, generator=g))
