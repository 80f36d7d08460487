"""fp32 against int8 target (`python -m bench quantize`): what int8 costs in agreement and what it buys in memory and
speed, on the same prompts, side by side.

- top1_agreement: the share of positions where the int8 target's greedy token equals the fp32 target's, teacher-
  forced on the fp32 target's greedy reply (so one early difference does not hide the rest);
- identical_outputs: the share of prompts whose greedy replies are equal token for token, and common_prefix: the
  mean number of leading reply tokens they share;
- weights_mib: bytes of parameters and buffers (shared tensors once);
- tokens_per_s: vanilla decoding, each prompt run by both targets in turn; verify_ms: a verify round over n tokens
  at the shorter measured context (models.costmodel).
"""

from __future__ import annotations

import time

import torch

from bench.prompts import Prompt
from bench.runs import machine, now
from models.costmodel import measure_costs
from models.engine import SpeculativeEngine
from models.target import Target

SIZES = (1, 2, 5, 9, 17)


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


def run_quantize(fp32: Target, int8: Target, prompts: list[Prompt], max_new_tokens: int) -> dict:
    engines = {"fp32": SpeculativeEngine(fp32, None), "int8": SpeculativeEngine(int8, None)}
    new, seconds, replies = {m: 0 for m in engines}, {m: 0.0 for m in engines}, {}
    for m, e in engines.items():  # warm-up
        e.generate(prompts[0].turns[0], max_new_tokens=8)
    agree = positions = identical = prefix = 0
    for p in prompts:
        ids = fp32.encode_chat([{"role": "user", "content": p.turns[0]}])
        for m, e in engines.items():
            t = time.perf_counter()
            replies[m] = e.generate(ids, max_new_tokens=max_new_tokens).token_ids
            seconds[m] += time.perf_counter() - t
            new[m] += len(replies[m])
        a, b = replies["fp32"], replies["int8"]
        agree += teacher_forced_agreement(fp32, int8, ids, a)
        positions += len(a)
        identical += a == b
        prefix += next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    costs = {m: measure_costs(t) for m, t in (("fp32", fp32), ("int8", int8))}
    targets = {"fp32": fp32, "int8": int8}
    return {
        "settings": {"benchmark": "quantize", "machine": machine(), "threads": torch.get_num_threads(),
                     "torch": torch.__version__, "target": fp32.name, "n_prompts": len(prompts),
                     "max_new_tokens": max_new_tokens, "date": now()},
        "agreement": {"top1_agreement": agree / max(1, positions), "identical_outputs": identical / len(prompts),
                      "common_prefix": prefix / len(prompts), "positions": positions},
        "targets": {m: {"weights_mib": weights_mib(targets[m]), "tokens_per_s": new[m] / seconds[m],
                        "verify_ms": {n: 1e3 * costs[m].verify_s[0][n] for n in SIZES},
                        "verify_context": costs[m].contexts[0]} for m in targets},
    }


def markdown(results: dict) -> str:
    s, a, t = results["settings"], results["agreement"], results["targets"]
    lines = [f"# fp32 vs int8 target\n\n{s['target']}, {s['n_prompts']} prompts, {s['max_new_tokens']} new tokens, "
             f"{s['threads']} threads, {s['machine']['processor']}; {s['date']}\n",
             f"int8 vs fp32 greedy: top-1 agreement {a['top1_agreement']:.1%} (teacher-forced, {a['positions']} "
             f"positions), identical replies {a['identical_outputs']:.0%}, common prefix {a['common_prefix']:.1f} "
             "tokens\n",
             "| target | weights MiB | vanilla tokens/s | " + " | ".join(f"verify {n} ms" for n in SIZES) + " |",
             "|---|---|---|" + "---|" * len(SIZES)]
    for m, f in t.items():
        lines.append(f"| {m} | {f['weights_mib']:.0f} | {f['tokens_per_s']:.1f} | " +
                     " | ".join(f"{f['verify_ms'][n]:.1f}" for n in SIZES) + " |")
    return "\n".join(lines) + "\n"
