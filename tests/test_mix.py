"""`python -m models.mix`: a leg's new rows plus replay, reproducible from its arguments; bad input says what."""

from __future__ import annotations

import gzip
import json

import pytest

from models.mix import main as mix_main


def write_rows(path, tag: str, n: int) -> list[str]:
    rows = [json.dumps({"id": f"{tag}{i}", "conversations": [{"role": "user", "content": f"é {i}"}]},
                       ensure_ascii=False) for i in range(1, n + 1)]
    text = "\n".join(rows) + "\n\n"  # a blank line at the end is not a row
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text, encoding="utf-8")
    return rows


@pytest.fixture
def files(tmp_path):
    fresh = write_rows(tmp_path / "fresh.jsonl.gz", "f", 30)
    old = write_rows(tmp_path / "old.jsonl", "o", 50)
    return tmp_path, fresh, old


def run(tmp_path, name: str, *args: str) -> list[str]:
    mix_main([*args, "--out", str(tmp_path / name)])
    return (tmp_path / name).read_text(encoding="utf-8").splitlines()


def test_a_mix_holds_the_new_rows_and_drawn_replay_the_same_for_the_same_seed(files):
    tmp, fresh, old = files
    args = ("--new", f"{tmp}/fresh.jsonl.gz:21-30", "--replay", f"{tmp}/fresh.jsonl.gz:1-20", f"{tmp}/old.jsonl",
            "--replay-ratio", "3")
    a = run(tmp, "a.jsonl", *args, "--seed", "7")
    assert len(a) == 40 and sorted(a) == sorted(set(a))  # 10 new + 30 replay, no row twice
    assert set(fresh[20:]) <= set(a)  # every new row, byte for byte (non-ASCII kept)
    assert set(a) - set(fresh[20:]) <= set(fresh[:20] + old)  # the rest from the replay ranges only
    assert a == run(tmp, "b.jsonl", *args, "--seed", "7")
    assert a != run(tmp, "c.jsonl", *args, "--seed", "8")
    assert sorted(run(tmp, "d.jsonl", "--new", f"{tmp}/old.jsonl:41-", "--replay-ratio", "0")) == sorted(old[40:])


@pytest.mark.parametrize("args, message", [
    (["--new", "{tmp}/missing.jsonl"], "no conversations file at {tmp}/missing.jsonl"),
    (["--new", "{tmp}/old.jsonl:40-60"], "old.jsonl has 50 rows, not 60"),
    (["--new", "{tmp}/old.jsonl:9-3"], "rows are FIRST-LAST with 1 <= FIRST <= LAST"),
    (["--new", "{tmp}/old.jsonl:0-3"], "rows are FIRST-LAST with 1 <= FIRST <= LAST"),
    (["--new", "{tmp}/old.jsonl:a-b"], "rows are FIRST-LAST, 1-based"),
    (["--new", "{tmp}/old.jsonl:51-"], "--new holds no rows"),
    (["--new", "{tmp}/fresh.jsonl.gz", "--replay", "{tmp}/old.jsonl"], "asks for 120 replay rows, the replay files "
                                                                        "hold 50"),
    (["--new", "{tmp}/old.jsonl", "--replay-ratio", "-1"], "--replay-ratio must be >= 0"),
    (["--new", "{tmp}/old.jsonl", "--out", "{tmp}/old.jsonl"], "exists: a mix is written once"),
])
def test_bad_input_says_what_is_wrong_and_writes_nothing(files, args, message):
    tmp = files[0]
    before = sorted(p.name for p in tmp.iterdir())
    args = [a.format(tmp=tmp) for a in args]
    if "--out" not in args:
        args += ["--out", str(tmp / "mix.jsonl")]
    with pytest.raises(SystemExit, match="error: .*" + message.format(tmp=tmp).replace("+", r"\+")):
        mix_main(args)
    assert sorted(p.name for p in tmp.iterdir()) == before
