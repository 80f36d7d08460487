"""Tokenizer and chat-template rendering on the edge, without transformers.

`ChatTemplate` renders messages with the target's Jinja chat template the way transformers'
`apply_chat_template` does (sandboxed Jinja, trim_blocks/lstrip_blocks, loop controls, `tojson`,
`raise_exception`, `strftime_now`, the tokenizer's special tokens as variables), so the edge tokenises
exactly the prompt the server would. `ChatTokenizer` pairs it with a `tokenizers.Tokenizer`.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Iterable

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """Like transformers' `tojson`: plain json.dumps, no HTML escaping."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    """A compiled chat template plus the special-token strings it may refer to (`bos_token`, `eos_token`, ...)."""

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        self._template = env.from_string(source)

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """The prompt text for `messages` (extra template variables go in kwargs)."""
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     **{**self.special_tokens, **kwargs})


class ChatTokenizer:
    """The target's tokenizer (a `tokenizers` JSON file) and chat template, as the edge uses them."""

    def __init__(self, tokenizer_file: str | Path, template: ChatTemplate, eos_token_ids: Iterable[int]):
        self.tokenizer = Tokenizer.from_file(str(tokenizer_file))
        self.template = template
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` as is (special tokens written in the text are parsed, none are added)."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Render `messages` with the chat template and tokenise: transformers' apply_chat_template(tokenize=True)."""
        return self.encode(self.template.render(messages, add_generation_prompt))

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def special_token_ids(self) -> set[int]:
        """The special tokens' ids (chat markers, end of text) and the end-of-turn ids."""
        added = self.tokenizer.get_added_tokens_decoder()
        return {int(i) for i, token in added.items() if token.special} | set(self.eos_token_ids)

    def token_texts(self) -> list[str]:
        """Every token of the vocabulary decoded alone, special tokens included, by id."""
        return self.tokenizer.decode_batch([[i] for i in range(self.tokenizer.get_vocab_size())],
                                           skip_special_tokens=False)
