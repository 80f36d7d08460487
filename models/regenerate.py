"""On-policy data: the target answers the prompts of a conversation source itself.

A drafter imitates what the target says, so training on the target's own answers (greedy, like the benchmark)
raises acceptance. Batched, resumable (appends to the output and skips ids already there), with a progress bar.

    python -m models.regenerate --source sharegpt --out data/onpolicy.jsonl --n 1000
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from tqdm import tqdm

from models.data import iter_source, normalize
from models.target import load_target


def prompts(source: str, tokenizer, max_prompt_tokens: int):
    """(id, messages up to the first user turn) for usable samples whose prompt fits."""
    for n, sample in enumerate(iter_source(source)):
        messages = normalize(sample)
        if isinstance(messages, str):
            continue
        first_user = next(i for i, m in enumerate(messages) if m["role"] == "user")
        prompt = messages[: first_user + 1]
        ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
        ids = ids if isinstance(ids, list) else ids["input_ids"]
        if len(ids) <= max_prompt_tokens:
            yield str(sample.get("id", n)), prompt, ids


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="default", help="target alias, HF id or path")
    p.add_argument("--source", default="sharegpt", help="'sharegpt' or a conversations jsonl")
    p.add_argument("--out", required=True, help="output jsonl (appended to; existing ids are skipped)")
    p.add_argument("--n", type=int, default=1000, help="conversations to have in the output")
    p.add_argument("--max-prompt-tokens", type=int, default=256)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy, as the benchmark decodes")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    target = load_target(args.target)
    tok = target.tokenizer
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = {json.loads(line)["id"] for line in open(out)} if out.exists() else set()
    todo = []
    for sid, prompt, ids in prompts(args.source, tok, args.max_prompt_tokens):
        if len(done) + len(todo) >= args.n:
            break
        if sid not in done:
            todo.append((sid, prompt, ids))
    todo.sort(key=lambda x: len(x[2]))  # similar lengths batch with little padding
    pad = tok.pad_token_id if tok.pad_token_id is not None else sorted(target.eos_token_ids)[0]
    bar = tqdm(total=len(todo), desc="regenerate", unit="conv")
    t0, new_tokens = time.time(), 0
    with open(out, "a") as f:
        for b in range(0, len(todo), args.batch_size):
            batch = todo[b : b + args.batch_size]
            width = max(len(x[2]) for x in batch)
            ids = torch.tensor([[pad] * (width - len(x[2])) + x[2] for x in batch])
            attn = torch.tensor([[0] * (width - len(x[2])) + [1] * len(x[2]) for x in batch])
            sample = args.temperature > 0
            gen = target.model.generate(
                input_ids=ids, attention_mask=attn, max_new_tokens=args.max_new_tokens, do_sample=sample,
                temperature=args.temperature if sample else None, top_p=None, top_k=None, pad_token_id=pad,
            )
            for (sid, prompt, _), row in zip(batch, gen[:, width:].tolist()):
                stop = next((i for i, t in enumerate(row) if t in target.eos_token_ids), len(row))
                new_tokens += stop
                reply = tok.decode(row[:stop], skip_special_tokens=True)
                conv = prompt + [{"role": "assistant", "content": reply}]
                f.write(json.dumps({"id": sid, "conversations": conv, "generated_by": target.name}) + "\n")
            f.flush()
            bar.update(len(batch))
            bar.set_postfix(tok_s=f"{new_tokens / (time.time() - t0):.0f}")
    bar.close()


if __name__ == "__main__":
    main()
