"""The Mixture-of-Attentions drafter (Zimmer et al., ICLR 2025), exactly as docs/design.md §3 states it."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from models.drafter import Drafter, DraftOutput
from models.layers import CrossAttentionLayer, DecoderLayer, LayerConfig, attend
from models.target import Target, TargetSpec, TargetStep


@dataclass
class MoAConfig:
    """Every size of the MoA drafter. `for_target` scales the paper's choices to a target."""

    hidden_size: int
    vocab_size: int
    target_layers: int
    target_kv_width: int  # h_kv * d of the target: one layer's flattened key (or value)
    head_dim: int
    sa_heads: int
    sa_kv_heads: int
    sa_intermediate: int
    ca_heads: int
    ca_kv_heads: int
    ca_intermediate: int
    lsa_heads: int
    lsa_kv_heads: int
    lsa_intermediate: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    lsa_pool: str = "mean"  # mean: the paper's plain average of the L outputs; weighted: learned per-layer weights
    lsa_skip_layers: int = 0  # the last n target layers' raw [key; value] also reach m_t through a Linear (0: the paper)
    fused_memory: str = ""  # summary (m_s) | hidden (target's h_s): newest visible entry joins CA's queries
    tli: int = 0  # target layer inference: the CA output goes through the target's last `tli` layers (one device)

    @classmethod
    def for_target(cls, spec: TargetSpec, **overrides) -> "MoAConfig":
        lsa_width = 2 * spec.kv_width
        d = spec.head_dim
        values = dict(
            hidden_size=spec.hidden_size,
            vocab_size=spec.vocab_size,
            target_layers=spec.n_layers,
            target_kv_width=spec.kv_width,
            head_dim=d,
            sa_heads=spec.n_heads,
            sa_kv_heads=max(1, min(4, spec.n_kv_heads)),
            sa_intermediate=spec.intermediate_size,
            ca_heads=spec.n_heads,
            ca_kv_heads=max(1, min(4, spec.n_kv_heads)),
            ca_intermediate=spec.intermediate_size,
            lsa_heads=max(1, lsa_width // d),
            lsa_kv_heads=max(1, min(8, lsa_width // d) // 2 or 1),
            lsa_intermediate=2 * lsa_width,
            rope_theta=spec.rope_theta,
            rms_norm_eps=spec.rms_norm_eps,
        )
        values.update(overrides)
        return cls(**values)

    def sa(self) -> LayerConfig:
        return LayerConfig(self.hidden_size, self.sa_heads, self.sa_kv_heads, self.head_dim, self.sa_intermediate,
                           self.rope_theta, self.rms_norm_eps)

    def ca(self) -> LayerConfig:
        return LayerConfig(self.hidden_size, self.ca_heads, self.ca_kv_heads, self.head_dim, self.ca_intermediate,
                           self.rope_theta, self.rms_norm_eps)

    def lsa(self) -> LayerConfig:
        width = 2 * self.target_kv_width
        return LayerConfig(width, self.lsa_heads, self.lsa_kv_heads, width // self.lsa_heads,
                           self.lsa_intermediate, self.rope_theta, self.rms_norm_eps)


class MoADrafter(Drafter):
    arch = "moa"
    config_class = MoAConfig
    keeps_draft_cache = True

    def __init__(self, config: MoAConfig, target: Target):
        super().__init__(config, target)
        self.lsa = DecoderLayer(config.lsa())
        self.lsa_proj = nn.Linear(2 * config.target_kv_width, config.hidden_size, bias=False)
        self.sa = DecoderLayer(config.sa())
        self.ca = CrossAttentionLayer(config.ca())
        self.lsa_weights: nn.Parameter | None = None
        if config.lsa_pool == "weighted":
            self.use_weighted_pool()
        elif config.lsa_pool != "mean":
            raise ValueError(f"lsa_pool is mean or weighted, got {config.lsa_pool!r}")
        self.lsa_skip: nn.Linear | None = None
        if config.lsa_skip_layers:
            self.use_lsa_skip(config.lsa_skip_layers)
        self.fuse: nn.Linear | None = None
        if config.fused_memory:
            self.use_fused_memory(config.fused_memory)
        self.tli: TargetTail | None = None
        self.tli_scale: nn.Parameter | None = None
        self.tli_shift: nn.Parameter | None = None
        if config.tli:
            self.use_target_layers(config.tli, target)

    def use_weighted_pool(self) -> None:
        """Pool the LSA's L outputs with learned per-layer weights, starting at the plain mean (so a drafter
        trained with the mean keeps its function). The plain mean adds every layer's raw [key; value] to the
        residual sum alike, which buries the late layers that carry the target's next-token view."""
        if self.lsa_weights is None:
            L = self.config.target_layers
            self.lsa_weights = nn.Parameter(torch.full((L,), 1.0 / L, device=self.lsa_proj.weight.device,
                                                       dtype=self.lsa_proj.weight.dtype))
        self.config.lsa_pool = "weighted"

    def use_lsa_skip(self, n: int) -> None:
        """Add a Linear from the last `n` target layers' raw [key; value] straight to m_t, beside the LSA's pool.
        It starts at zero, so a trained drafter keeps its function. Why: the pool of L layer outputs keeps about
        what a plain layer mean keeps, while the last layer's [key; value] alone carries the target's next-token
        view (README, "Why MoA is stuck")."""
        L = self.config.target_layers
        if not 0 < n <= L:
            raise ValueError(f"lsa_skip_layers is 1..{L} (the target's layers), got {n}")
        if self.lsa_skip is not None and self.config.lsa_skip_layers != n:
            raise ValueError(f"this drafter's LSA skip reads {self.config.lsa_skip_layers} layers, not {n}")
        if self.lsa_skip is None:
            w = self.lsa_proj.weight
            self.lsa_skip = nn.Linear(n * w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
            nn.init.zeros_(self.lsa_skip.weight)
        self.config.lsa_skip_layers = n

    def use_fused_memory(self, source: str) -> None:
        """Add, for each position, the newest `source` it may see (its last sync point's: the memory summary m_s,
        or the target's last hidden state h_s) to the query stream before CA, through a Linear that starts at zero,
        so a trained drafter keeps its function. Each memory row then also carries it (hidden_size more numbers).
        Why: EAGLE's drafting position holds the target's state in its own stream; the paper's MoA reaches the
        target only through CA's attention over narrow key/value rows."""
        if source not in ("summary", "hidden"):
            raise ValueError(f"fused_memory is summary or hidden, got {source!r}")
        if self.fuse is not None and self.config.fused_memory != source:
            raise ValueError(f"this drafter fuses the {self.config.fused_memory}, not the {source}")
        if self.fuse is None:
            w = self.lsa_proj.weight
            self.fuse = nn.Linear(w.shape[0], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
            nn.init.zeros_(self.fuse.weight)
        self.config.fused_memory = source

    def use_target_layers(self, n: int, target: Target) -> None:
        """Target layer inference (the paper's TLI = n): the CA output becomes the drafter's estimate of the target's
        hidden state before its last n layers, and goes through copies of those layers (frozen, never saved) and the
        final norm before the LM head. Their attention reads the target's own cache of the verified tokens and the
        drafter's K/V of the drafted ones (`draft_step`'s `tli_past`), so the drafts pass the target's last layers as
        the target would run them. A drafter that had none must learn the new estimate (a leg with `--tli n`); it
        needs the target's cache, so it drafts on one device only (no edge bundle)."""
        L = self.config.target_layers
        if not 0 < n < L:
            raise ValueError(f"tli is 1..{L - 1} (target layers the drafts go through), got {n}")
        if self.tli is not None and self.config.tli != n:
            raise ValueError(f"this drafter goes through the target's last {self.config.tli} layers, not {n}")
        if self.tli is None:
            w = self.lsa_proj.weight
            self.tli = TargetTail(target, n).to(device=w.device, dtype=w.dtype)
            # per dimension, the drafter's output -> the tail's input (`calibrate_target_layers` sets its start)
            self.tli_scale = nn.Parameter(torch.ones(w.shape[0], device=w.device, dtype=w.dtype))
            self.tli_shift = nn.Parameter(torch.zeros(w.shape[0], device=w.device, dtype=w.dtype))
        self.config.tli = n

    @torch.no_grad()
    def calibrate_target_layers(self, target: Target, sequences: list[list[int]]) -> None:
        """Start the map into the tail where, per dimension, the drafter's output on `sequences` has the mean and
        spread of the target's own hidden state there. Why: the residual stream entering a target's last layers is
        far larger than a drafter's output (SmolLM2's last layer: rms 76 and dimensions in the hundreds, against
        about 2 for its final hidden state), and at a drafter's learning rate the weights take thousands of steps to
        get there: from the shipped drafter, top-1 stayed at 0.05 for 30 steps."""
        xs, inners = [], []
        for seq in sequences:
            ids = torch.tensor([seq], device=self.lsa_proj.weight.device)
            t = ids.shape[1]
            step = target.full_forward(ids)
            states = target.model.model(input_ids=ids, output_hidden_states=True).hidden_states
            inners.append(states[-1 - self.config.tli][0])
            causal = torch.full((t, t), float("-inf"), device=ids.device).triu(1).view(1, 1, t, t)
            positions = torch.arange(t, device=ids.device).view(1, t)
            xs.append(self.train_forward(ids, step, positions, causal, causal).features[0])
        x, inner = torch.cat(xs).float(), torch.cat(inners).float()  # memory up to each position, as at depth 0
        scale = inner.std(0) / x.std(0).clamp(min=1e-6)
        self.tli_scale.copy_(scale)
        self.tli_shift.copy_(inner.mean(0) - scale * x.mean(0))

    def tail_input(self, x: torch.Tensor) -> torch.Tensor:
        """The drafter's output -> its estimate of the hidden state entering the target's last `tli` layers."""
        return x * self.tli_scale + self.tli_shift

    def target_context(self, keys: torch.Tensor, values: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The TLI layers' slice of a target step's flattened K/V (B, L, n, h_kv*d) -> per layer (B, h_kv, n, d)."""
        h = self.tli.kv_heads
        heads = lambda x: x.unflatten(-1, (h, -1)).transpose(1, 2)  # noqa: E731 (split_heads, for n = 0 too)
        return [(heads(keys[:, i]), heads(values[:, i])) for i in range(-self.config.tli, 0)]

    def added_parameters(self) -> list[nn.Parameter]:
        added = [self.lsa_weights, self.tli_scale, self.tli_shift] + [m.weight for m in (self.lsa_skip, self.fuse)
                                                                      if m is not None]
        return [p for p in added if p is not None]

    def widen_memory(self, kv_heads: int) -> None:
        """Give CA `kv_heads` key/value heads, so that each memory row carries 2 * kv_heads * d numbers instead of
        2 * ca_kv_heads * d. Query head j read key/value head j // g (g query heads a group); the new heads start as
        copies along that map, so the drafter keeps its function. Why: a row of 3 heads of 64 is narrower than the
        target's hidden state, and a probe reads less of the target's next-token view from it than from m_t."""
        old, c = self.config.ca_kv_heads, self.config
        if kv_heads == old:
            return
        if kv_heads < old or kv_heads % old or c.ca_heads % kv_heads:
            raise ValueError(f"CA can widen from {old} key/value heads to a multiple of {old} that divides its "
                             f"{c.ca_heads} query heads, not {kv_heads}")
        heads = torch.arange(kv_heads) // (kv_heads // old)  # the old head each new one copies
        a = self.ca.self_attn
        for name in ("k_proj", "v_proj"):
            w = getattr(a, name).weight.detach().view(old, c.head_dim, -1)[heads].reshape(kv_heads * c.head_dim, -1)
            layer = nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
            layer.weight.data.copy_(w)
            setattr(a, name, layer)
        c.ca_kv_heads = kv_heads
        self.ca.c.n_kv_heads = kv_heads

    @property
    def row_width(self) -> int:
        return self.ca.row_width + (self.config.hidden_size if self.fuse is not None else 0)

    def target_layers(self) -> dict[str, int]:
        return {"sa": 0, "ca": -1}

    def cache_shape(self) -> tuple[int, int]:
        return self.config.sa_kv_heads, self.config.head_dim

    def layer_summary(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """LSA: per token, a decoder layer over the L per-layer [key; value] vectors, mean, Linear -> m (B,n,H);
        plus the skip from the last layers' raw [key; value] when the drafter has one."""
        b, L, n, w = keys.shape
        kv = torch.cat([keys, values], dim=-1).permute(0, 2, 1, 3).reshape(b * n, L, 2 * w)
        layer_pos = torch.arange(L, device=kv.device).view(1, L)  # broadcasts over the b*n tokens
        z, _, _ = self.lsa(kv, layer_pos, None)
        pooled = z.mean(dim=1) if self.lsa_weights is None else torch.einsum("tld,l->td", z, self.lsa_weights)
        m = self.lsa_proj(pooled)
        if self.lsa_skip is not None:
            m = m + self.lsa_skip(kv[:, L - self.config.lsa_skip_layers:].flatten(1))
        return m.view(b, n, -1)

    def summary(self, step: TargetStep) -> torch.Tensor:
        """m_t (B, n, H) of the verified tokens whose activations `step` holds."""
        dtype = self.lsa_proj.weight.dtype
        return self.layer_summary(step.keys.to(dtype), step.values.to(dtype))

    def memory_rows(self, step: TargetStep, positions: torch.Tensor) -> torch.Tensor:
        """CA's [key; value] of m_t, then what the drafter fuses (m_t or the target's h_t) when it fuses one."""
        m = self.summary(step)
        rows = self.ca.memory(m, positions)
        if self.fuse is None:
            return rows
        return torch.cat([rows, m if self.config.fused_memory == "summary" else step.hidden.to(m.dtype)], dim=-1)

    def draft_step(self, ids, positions, past_k, past_v, mask, memory=None, features=None, memory_mask=None,
                   with_logits=True, fused_mask=None, tli_past=None):
        """`fused_mask` (training only) picks the fused entry from other rows than CA sees (default: CA's).

        With TLI, `tli_past` holds per TLI layer the K/V (B, h_kv, Q, d) of the first Q >= T cache slots (the
        target's for verified tokens, the drafter's for drafted ones; Q > T when new rows are verified tokens, which
        then keep the target's); the new rows from slot Q on add their own (`out.tli_kv`), and `mask` covers T + n
        slots as for SA. None: no slot before the new rows (Q = T = 0)."""
        x = self.embed(ids)
        x, k, v = self.sa(x, positions, mask, past_k, past_v)
        if self.fuse is not None:
            width = self.ca.row_width
            picked = memory_mask if fused_mask is None else fused_mask
            x = x + self.fuse(newest_visible(memory[..., width:], picked))
            memory = memory[..., :width]
        x = self.ca(x, positions, memory, memory_mask)
        if self.tli is None:
            return DraftOutput(self.head(x) if with_logits else None, x, k, v)
        slots = 0 if past_k is None else past_k.shape[2]
        own_from = 0 if tli_past is None else tli_past[0][0].shape[2] - slots
        final, tli_kv = self.tli(self.tail_input(x), positions, mask, tli_past, own_from)
        return DraftOutput(self.head(final) if with_logits else None, x, k, v, head_input=final, tli_kv=tli_kv)

    def train_forward(self, ids, step: TargetStep, positions, sa_mask, memory_mask, memory=None,
                      fused_mask=None) -> DraftOutput:
        """Whole sequences in one pass: memory rows of every position, CA limited by `memory_mask` (sync points)."""
        memory = self.memory_rows(step, positions) if memory is None else memory
        out = self.draft_step(ids, positions, None, None, sa_mask, memory=memory, memory_mask=memory_mask,
                              with_logits=False, fused_mask=fused_mask)
        if self.tli is not None:
            # the TLI layers at i see the target's K/V of the verified tokens (CA's memory mask: j <= s(i)) and
            # their own of the drafted ones, s(i) < j <= i
            t = ids.shape[1]
            index = torch.arange(t, device=ids.device)
            i, j = index.view(t, 1), index.view(1, t)
            last = (memory_mask[:, 0] == 0).long().cumsum(-1).argmax(-1, keepdim=True)  # (B|1, t, 1): s(i)
            drafted = (j > last) & (j <= i)
            own = memory_mask.new_zeros(drafted.shape).masked_fill(~drafted, float("-inf"))
            mask = torch.cat([memory_mask, own.unsqueeze(1)], dim=-1)
            out.head_input, _ = self.tli(self.tail_input(out.features), positions, mask,
                                         self.target_context(step.keys, step.values), 0)
        out.memory = memory
        return out


class TargetTail(nn.Module):
    """Copies of the target's last n decoder layers and its final norm (and rotary embedding), frozen: TLI."""

    def __init__(self, target: Target, n: int):
        super().__init__()
        model = target.model.model
        layers = model.layers[: model.config.num_hidden_layers]
        self.layers = nn.ModuleList(copy.deepcopy(list(layers[len(layers) - n:])))
        self.norm = copy.deepcopy(model.norm)
        self.rotary = copy.deepcopy(model.rotary_emb)
        self.kv_heads = target.spec.n_kv_heads
        self.requires_grad_(False)

    def forward(self, x, positions, mask, past, own_from: int):
        """x (B, n, H) at `positions` (B, n); past: per layer (k, v) (B, h_kv, Q, d) or None; the rows from
        `own_from` on add their own K/V after it (the earlier rows' slots are in `past`); mask (B|1, 1, n, slots).
        -> the final-normed output (the LM head's input) and per layer the K/V the rows added."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        cos, sin = self.rotary(x, position_ids=positions)
        added = []
        for i, layer in enumerate(self.layers):
            a = layer.self_attn
            h = layer.input_layernorm(x)
            shape = (*x.shape[:2], -1, a.head_dim)
            q, k, v = (proj(h).view(shape).transpose(1, 2) for proj in (a.q_proj, a.k_proj, a.v_proj))
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            k, v = k[:, :, own_from:], v[:, :, own_from:]
            added.append((k, v))
            if past is not None:
                k, v = torch.cat([past[i][0].to(k.dtype), k], 2), torch.cat([past[i][1].to(v.dtype), v], 2)
            x = x + a.o_proj(attend(q, k, v, mask))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x), added


def extend(past: list[tuple[torch.Tensor, torch.Tensor]], added: list[tuple[torch.Tensor, torch.Tensor]]):
    """TLI context: per layer, the K/V of `past` slots followed by those `added` (`DraftOutput.tli_kv`)."""
    return [(torch.cat([pk, ak], 2), torch.cat([pv, av], 2)) for (pk, pv), (ak, av) in zip(past, added)]


def newest_visible(entries: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """entries (B, M, w), CA's additive mask (B|1, 1, n, M) or None (all visible) -> per query the newest entry it
    sees: (B, n, w), or (B, 1, w) without a mask."""
    if mask is None:
        return entries[:, -1:]
    index = torch.arange(entries.shape[1], device=entries.device)
    newest = torch.where(mask[:, 0] == 0, index, 0).amax(-1)  # (B|1, n)
    newest = newest.expand(entries.shape[0], -1).unsqueeze(-1).expand(-1, -1, entries.shape[-1])
    return entries.gather(1, newest)
