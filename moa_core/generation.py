"""What every generation loop shares: how a prompt becomes token ids, and when generation stops.

The single-device engine, the edge client and the server's api mode all use these, so the same prompt gives the
same ids and the same output ends at the same token everywhere.
"""

from __future__ import annotations

from typing import Callable, Optional, Union

Prompt = Union[str, list[dict], list[int]]  # text (one user turn), chat messages, or token ids


def encode_prompt(prompt: Prompt, encode_chat: Callable[[list[dict]], list[int]]) -> list[int]:
    """Token ids of a prompt: text is one user turn, dicts are chat messages (chat template), ints pass as is."""
    if isinstance(prompt, str):
        return encode_chat([{"role": "user", "content": prompt}])
    if prompt and isinstance(prompt[0], dict):
        return encode_chat(prompt)
    return [int(t) for t in prompt]


class StopRule:
    """Where generated tokens end: the first EOS (kept), the first stop string, or `max_new` tokens."""

    def __init__(self, eos: set[int], decode: Callable[[list[int]], str] | None = None,
                 stop: list[str] | None = None):
        if stop and decode is None:
            raise ValueError("stop strings need a decode function")
        self.eos = set(eos)
        self.decode = decode
        self.stop = stop or []

    def cut(self, tokens: list[int], max_new: int) -> tuple[list[int], Optional[str]]:
        """The generated tokens to keep, and why generation ends ("eos", "stop", "length"; None: go on)."""
        for i, t in enumerate(tokens[:max_new]):
            if t in self.eos:
                return tokens[: i + 1], "eos"
        if self.stop:
            text = self.decode(tokens[:max_new])
            for s in self.stop:
                if s in text:
                    for i in range(1, len(tokens) + 1):  # the shortest prefix that contains the stop string
                        if s in self.decode(tokens[:i]):
                            return tokens[:i], "stop"
        if len(tokens) >= max_new:
            return tokens[:max_new], "length"
        return tokens, None
