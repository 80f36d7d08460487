"""On-policy data: the target answers the prompts of a conversation source itself.

A drafter imitates what the target says, so training on the target's own answers (greedy, like the benchmark)
raises acceptance. `--temperature T` samples instead: more answers from the target's own distribution to the same
prompts once the greedy ones are all there (rows get the id suffix `@tT`, so greedy and sampled rows can share a
file). Batched decoding with a KV cache (finished rows leave the batch, so long answers do
not keep short ones' slots busy), resumable (appends to the output and skips ids already there), with a
progress bar in tokens/s.

    python -m models.regenerate --source sharegpt --out data/onpolicy.jsonl --n 1000
    python -m models.regenerate --source humaneval --out data/onpolicy.jsonl --n 1100   # adds code prompts
    python -m models.regenerate --source bench/sharegpt_heldout.jsonl --out data/heldout.jsonl   # Spec-Bench
    python -m models.regenerate --source sharegpt --out data/sampled.jsonl --n 3000 --temperature 0.8

Prompts whose id is in `--exclude` (a jsonl with `id` or `question_id`, e.g. the benchmark's held-out prompts)
are never answered, so a drafter trained on the output has not seen the benchmark.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Iterator

import torch
from tqdm import tqdm

from models.data import humaneval_chats, iter_source, normalize
from models.registry import LOAD_ERRORS, load_target

ONPOLICY_PREFIX = "onpolicy-"


def iter_prompt_source(source: str) -> Iterator[dict]:
    """Conversations from 'sharegpt', 'humaneval' or a jsonl (conversations, or Spec-Bench `turns` rows)."""
    if source == "humaneval":
        for task, turn in humaneval_chats(heldout=False):
            yield {"id": task, "conversations": [{"role": "user", "content": turn}]}
        return
    for sample in iter_source(source):
        if isinstance(sample, dict) and isinstance(sample.get("turns"), list) and sample["turns"]:
            yield {"id": sample.get("question_id"), "conversations": [{"role": "user", "content": sample["turns"][0]}]}
        else:
            yield sample


def read_ids(path: str | None) -> set[str]:
    """Ids (`id` or `question_id`, with and without the on-policy prefix) of a jsonl file."""
    if not path:
        return set()
    ids = set()
    for row in iter_source(path):
        sid = str(row.get("id", row.get("question_id", "")))
        ids |= {sid, sid.removeprefix(ONPOLICY_PREFIX)}
    return ids


def prompts(source: str, tokenizer, max_prompt_tokens: int, exclude: set[str] = frozenset()):
    """(id, messages up to the first user turn, ids) for usable samples whose prompt fits."""
    for n, sample in enumerate(iter_prompt_source(source)):
        sid = str(sample.get("id", n)) if isinstance(sample, dict) else str(n)
        if sid in exclude:
            continue
        conv = sample.get("conversations") if isinstance(sample, dict) else None
        if not isinstance(conv, list):
            continue
        # a prompt needs only a user turn: give normalize() a placeholder answer to satisfy its checks
        messages = normalize({"conversations": conv + [{"role": "assistant", "content": "."}]})
        if isinstance(messages, str):
            continue
        first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
        if first_user is None:
            continue
        prompt = messages[: first_user + 1]
        ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
        ids = ids if isinstance(ids, list) else ids["input_ids"]
        if len(ids) <= max_prompt_tokens:
            yield sid, prompt, list(ids)


@torch.no_grad()
def answer_batch(model, prompts: list[list[int]], max_new_tokens: int, eos: set[int], pad: int,
                 temperature: float = 0.0, generator: torch.Generator | None = None) -> list[list[int]]:
    """Answers (without the end-of-turn token) to left-padded prompts, decoded together: greedy at temperature 0,
    else sampled from softmax(logits / temperature)."""
    from transformers import DynamicCache

    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    attn = (torch.arange(width).view(1, -1) >= torch.tensor([width - len(p) for p in prompts]).view(-1, 1)).long()
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    out: list[list[int]] = [[] for _ in prompts]
    alive = list(range(len(prompts)))
    logits = model(input_ids=ids, attention_mask=attn, position_ids=pos, cache=cache, use_cache=True,
                   logits_to_keep=1).logits[:, -1]
    while True:
        if temperature > 0:
            nxt = torch.multinomial(torch.softmax(logits.float() / temperature, -1), 1, generator=generator)[:, 0]
        else:
            nxt = logits.argmax(-1)
        keep = []
        for row, (i, t) in enumerate(zip(alive, nxt.tolist())):
            if t not in eos:
                out[i].append(t)
                if len(out[i]) < max_new_tokens:
                    keep.append(row)
        if not keep:
            return out
        if len(keep) < len(alive):
            sel = torch.tensor(keep)
            cache.batch_select_indices(sel)
            attn, pos, nxt = attn[sel], pos[sel], nxt[sel]
            alive = [alive[r] for r in keep]
        attn = torch.cat([attn, torch.ones(len(alive), 1, dtype=attn.dtype)], dim=-1)
        pos = pos[:, -1:] + 1
        logits = model(input_ids=nxt.view(-1, 1), attention_mask=attn, position_ids=pos, cache=cache,
                       use_cache=True, logits_to_keep=1).logits[:, -1]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="default", help="target alias, HF id or path")
    p.add_argument("--source", default="sharegpt",
                   help="'sharegpt', 'humaneval' (problems 82..163) or a jsonl of conversations / Spec-Bench rows")
    p.add_argument("--out", required=True, help="output jsonl (appended to; existing ids are skipped)")
    p.add_argument("--n", type=int, default=1000, help="conversations to have in the output (all sources)")
    p.add_argument("--exclude", default=None, help="jsonl whose ids are never answered (held-out prompts)")
    p.add_argument("--max-prompt-tokens", type=int, default=256)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--quantize", choices=["none", "int8"], default="none",
                   help="int8: int8 Linear layers, ~2x faster on a CPU; answers drift slightly from the fp32 "
                        "target's (recorded in each row's generated_by)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0: greedy answers (what the greedy benchmark sees); > 0: sampled answers, ids get '@tT'")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.temperature < 0:
        p.error("--temperature must be >= 0")
    if args.threads:
        torch.set_num_threads(args.threads)

    try:  # the target and the prompts: a bad name or path says so before any work
        target = load_target(args.target, quantize=args.quantize)
        tok = target.tokenizer
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        suffix = f"@t{args.temperature:g}" if args.temperature > 0 else ""
        done = {json.loads(line)["id"] for line in open(out)} if out.exists() else set()
        exclude = read_ids(args.exclude) | {i.removesuffix(suffix) for i in done if i.endswith(suffix)}
        todo = []
        for item in prompts(args.source, tok, args.max_prompt_tokens, exclude):
            if len(done) + len(todo) >= args.n:
                break
            todo.append(item)
    except LOAD_ERRORS as e:
        sys.exit(f"error: {e}")
    # similar lengths batch with little padding; sorting within chunks keeps a stopped run a fair sample
    chunk = 16 * args.batch_size
    todo = [x for i in range(0, len(todo), chunk) for x in sorted(todo[i : i + chunk], key=lambda x: len(x[2]))]
    pad = tok.pad_token_id if tok.pad_token_id is not None else sorted(target.eos_token_ids)[0]
    label = target.label + (f", sampled at temperature {args.temperature:g}" if suffix else "")
    generator = torch.Generator().manual_seed(args.seed)
    bar = tqdm(total=len(todo), desc="regenerate", unit="conv")
    t0, new_tokens = time.time(), 0
    with open(out, "a") as f:
        for b in range(0, len(todo), args.batch_size):
            batch = todo[b : b + args.batch_size]
            answers = answer_batch(target.model, [x[2] for x in batch], args.max_new_tokens, target.eos_token_ids, pad,
                                   args.temperature, generator)
            for (sid, prompt, _), answer in zip(batch, answers):
                new_tokens += len(answer)
                reply = tok.decode(answer, skip_special_tokens=True)
                conv = prompt + [{"role": "assistant", "content": reply}]
                f.write(json.dumps({"id": sid + suffix, "conversations": conv, "generated_by": label,
                                    "answer_tokens": len(answer)}) + "\n")
            f.flush()
            bar.update(len(batch))
            bar.set_postfix(tokens=new_tokens, tok_s=f"{new_tokens / (time.time() - t0):.0f}")
    bar.close()


if __name__ == "__main__":
    main()
