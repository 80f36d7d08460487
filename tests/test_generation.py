"""The prompt and stop rules every generation loop shares (moa_core.generation)."""

import pytest

from moa_core.generation import StopRule, encode_prompt


def chat(messages: list[dict]) -> list[int]:
    return [len(m["content"]) for m in messages] + [99]


def test_encode_prompt_text_messages_and_ids():
    assert encode_prompt("abc", chat) == [3, 99]
    assert encode_prompt([{"role": "user", "content": "ab"}, {"role": "assistant", "content": "c"}], chat) == [2, 1, 99]
    assert encode_prompt([5, 6], chat) == [5, 6]


def test_stop_rule_eos_length_and_stop_strings():
    decode = lambda ids: "".join(chr(96 + t) for t in ids)  # 1 -> "a", 2 -> "b", ...
    rule = StopRule({0}, decode, stop=["cd"])
    assert rule.cut([1, 2], 5) == ([1, 2], None)
    assert rule.cut([1, 0, 2], 5) == ([1, 0], "eos")
    assert rule.cut([1, 2, 3, 4, 5], 10) == ([1, 2, 3, 4], "stop")
    assert rule.cut([1, 2, 5, 6], 3) == ([1, 2, 5], "length")
    assert StopRule({0}).cut([0, 3, 4], 5) == ([0], "eos")
    with pytest.raises(ValueError):
        StopRule({0}, stop=["x"])
