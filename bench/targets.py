"""Builds of one target side by side (`python -m bench targets`): what a kernel, a quantisation or a dtype costs in
agreement and in losslessness, and what it buys in memory and speed, on the same prompts.

Builds: `fp32` (the reference: float32, oneDNN GEMM on a CPU), `fp32-mkl` (float32 on PyTorch's default MKL GEMM),
`int8` (int8 Linear layers, models/quant.py), `bf16` (bfloat16 weights and activations).

- top1_agreement: the share of positions where the build's greedy token equals the reference's, teacher-forced on
  the reference's greedy reply (so one early difference does not hide the rest);
- identical_outputs: the share of prompts whose greedy replies equal the reference's token for token, and
  common_prefix: the mean number of leading reply tokens they share;
- call_shape: the build's logits for 8 tokens in one call against the same 8 tokens one call each (max abs
  difference, argmax flips): speculation verifies many tokens per call and vanilla decoding one, so a build whose
  argmax flips with the call shape cannot keep greedy speculation equal to its own greedy decoding;
- weights_mib: bytes of parameters and buffers (shared tensors once);
- tokens_per_s: vanilla decoding, each prompt run by every build in turn; verify_ms: a verify round over n tokens
  at the shorter measured context (models.costmodel).
"""

from __future__ import annotations

import time
from collections import Counter

import torch

from bench.prompts import Prompt
from bench.runs import machine, now
from edge_client.core import common_prefix
from models.costmodel import measure_costs
from models.cpu_gemm import use_mkl
from models.engine import SpeculativeEngine
from models.registry import load_target
from models.target import Target

SIZES = (1, 2, 5, 9, 17)
BUILDS = ("fp32", "fp32-mkl", "int8", "bf16")


def load_build(name: str, build: str) -> Target:
    if build not in BUILDS:
        raise ValueError(f"unknown target build {build!r} (choose from {', '.join(BUILDS)})")
    target = load_target(name, dtype=torch.bfloat16 if build == "bf16" else torch.float32,
                         quantize="int8" if build == "int8" else "none")
    if build == "fp32-mkl":
        use_mkl(target.model)
    return target


def weights_mib(target: Target) -> float:
    seen, size = set(), 0
    for t in list(target.model.parameters()) + list(target.model.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            size += t.numel() * t.element_size()
    return size / 2**20


@torch.no_grad()
def teacher_forced_agreement(reference: Target, other: Target, prompt: list[int], reply: list[int]) -> int:
    """Positions of `reply` where `other`'s argmax (given the reference's reply so far) equals the reply token."""
    logits = other.new_runner().forward(prompt + reply[:-1]).logits[len(prompt) - 1:]
    return int((logits.argmax(-1) == torch.tensor(reply)).sum())


@torch.no_grad()
def call_shape_consistency(target: Target, ids: list[int], n: int = 8) -> dict:
    """Logits of n tokens in one call vs one call each, after every n-token stretch of `ids` past its first half."""
    diff, flips, rows = 0.0, 0, 0
    for start in range(len(ids) // 2, len(ids) - n + 1, n):
        runner = target.new_runner()
        runner.forward(ids[:start], logits="none")
        whole = runner.forward(ids[start:start + n]).logits.float()
        runner.crop(start)
        single = torch.cat([runner.forward(ids[start + j:start + j + 1]).logits.float() for j in range(n)])
        diff = max(diff, (whole - single).abs().max().item())
        flips += int((whole.argmax(-1) != single.argmax(-1)).sum())
        rows += n
    return {"max_logit_diff": diff, "argmax_flips": flips, "positions": rows}


def run_targets(targets: dict[str, Target], prompts: list[Prompt], max_new_tokens: int) -> dict:
    """`targets`: builds by name, the first one the reference."""
    engines = {m: SpeculativeEngine(t, None) for m, t in targets.items()}
    reference = next(iter(targets))
    tally = {m: Counter() for m in engines}  # new tokens, seconds, agreeing positions, identical replies, prefix
    for e in engines.values():  # warm-up
        e.generate(prompts[0].turns[0], max_new_tokens=8)
    positions, transcripts = 0, []
    for p in prompts:
        ids = targets[reference].encode_chat([{"role": "user", "content": p.turns[0]}])
        replies = {}
        for m, e in engines.items():
            t = time.perf_counter()
            replies[m] = e.generate(ids, max_new_tokens=max_new_tokens).token_ids
            tally[m]["seconds"] += time.perf_counter() - t
            tally[m]["new"] += len(replies[m])
        a = replies[reference]
        positions += len(a)
        transcripts.append(ids + a)
        for m, b in replies.items():
            tally[m]["agree"] += teacher_forced_agreement(targets[reference], targets[m], ids, a)
            tally[m]["identical"] += a == b
            tally[m]["prefix"] += common_prefix(a, b)
    longest = max(transcripts, key=len)
    results = {}
    for m, target in targets.items():
        costs, n = measure_costs(target), tally[m]
        results[m] = {"weights_mib": weights_mib(target), "tokens_per_s": n["new"] / n["seconds"],
                      "verify_ms": {size: 1e3 * costs.verify_s[0][size] for size in SIZES},
                      "verify_context": costs.contexts[0], "top1_agreement": n["agree"] / max(1, positions),
                      "identical_outputs": n["identical"] / len(prompts), "common_prefix": n["prefix"] / len(prompts),
                      "call_shape": call_shape_consistency(target, longest)}
    return {
        "settings": {"benchmark": "targets", "machine": machine(), "threads": torch.get_num_threads(),
                     "torch": torch.__version__, "target": targets[reference].name, "reference": reference,
                     "n_prompts": len(prompts), "max_new_tokens": max_new_tokens, "positions": positions,
                     "date": now()},
        "targets": results,
    }


def markdown(results: dict) -> str:
    s, t = results["settings"], results["targets"]
    lines = [f"# Builds of {s['target']}\n\n{s['n_prompts']} prompts, {s['max_new_tokens']} new tokens, "
             f"{s['threads']} threads, {s['machine']['processor']}; {s['date']}. Agreement: teacher-forced on the "
             f"{s['reference']} build's greedy replies ({s['positions']} positions).\n",
             "| build | top-1 agreement | identical replies | common prefix | call-shape argmax flips | max logit diff "
             "| weights MiB | vanilla tokens/s | " + " | ".join(f"verify {n} ms" for n in SIZES) + " |",
             "|---|---|---|---|---|---|---|---|" + "---|" * len(SIZES)]
    for m, f in t.items():
        c = f["call_shape"]
        lines.append(f"| {m} | {f['top1_agreement']:.1%} | {f['identical_outputs']:.0%} | {f['common_prefix']:.1f} | "
                     f"{c['argmax_flips']} / {c['positions']} | {c['max_logit_diff']:.1e} | {f['weights_mib']:.0f} | "
                     f"{f['tokens_per_s']:.1f} | " + " | ".join(f"{f['verify_ms'][n]:.1f}" for n in SIZES) + " |")
    return "\n".join(lines) + "\n"
