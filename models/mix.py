"""A training leg's data: the rows no drafter has seen, plus rows drawn at random from earlier data for replay.

    python -m models.mix --new datasets/smollm2-sampled-t06.jsonl.gz:4193-5024 \\
        --replay datasets/smollm2-sampled-t06.jsonl.gz:1-4192 datasets/smollm2-sampled-t07.jsonl.gz \\
        datasets/smollm2-sampled.jsonl.gz datasets/smollm2-onpolicy.jsonl.gz \\
        --replay-ratio 4 --seed 32 --out data/mix32.jsonl

Each leg of the shipped drafters' campaign (docs/campaign.md) trains on such a mix; earlier legs drew it with
one-off scripts. Rows are copied as they are (stripped of surrounding blanks), so the same arguments give the
same file: the command above remakes leg 32's mix.
"""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import dataclass
from pathlib import Path

from models.data import iter_lines


class MixError(ValueError):
    """A file or row range that cannot make a mix."""


@dataclass(frozen=True)
class RowRange:
    """Rows `first`..`last` (1-based, inclusive; None: to the end) of a jsonl file, gzip when it ends in .gz."""

    path: Path
    first: int = 1
    last: int | None = None

    @classmethod
    def parse(cls, spec: str) -> "RowRange":
        """FILE, or FILE:FIRST-LAST, or FILE:FIRST- (to the end)."""
        path, _, rows = spec.rpartition(":") if ":" in spec and not Path(spec).exists() else (spec, "", "")
        if not rows:
            return cls(Path(path))
        first, dash, last = rows.partition("-")
        try:
            r = cls(Path(path), int(first), int(last) if last else None)
        except ValueError:
            raise MixError(f"{spec}: rows are FIRST-LAST, 1-based (e.g. {path}:1-500 or {path}:501-)") from None
        if not dash or r.first < 1 or (r.last is not None and r.last < r.first):
            raise MixError(f"{spec}: rows are FIRST-LAST with 1 <= FIRST <= LAST")
        return r

    def read(self) -> list[str]:
        if not self.path.is_file():
            raise MixError(f"no conversations file at {self.path}")
        lines = list(iter_lines(self.path))
        last = len(lines) if self.last is None else self.last
        if last > len(lines):
            raise MixError(f"{self.path} has {len(lines)} rows, not {last}")
        return lines[self.first - 1:last]


def mix_rows(new: list[str], replay: list[str], ratio: float, seed: int) -> list[str]:
    """`new` with round(ratio x len(new)) rows of `replay` drawn without replacement, shuffled (random.Random)."""
    n = round(ratio * len(new))
    if n > len(replay):
        raise MixError(f"--replay-ratio {ratio} asks for {n} replay rows, the replay files hold {len(replay)}")
    rng = random.Random(seed)
    rows = new + rng.sample(replay, n)
    rng.shuffle(rows)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m models.mix", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n")[1])
    p.add_argument("--new", nargs="+", required=True, metavar="FILE[:FIRST-LAST]",
                   help="rows no drafter has trained on (1-based row range, inclusive; omit it for the whole file)")
    p.add_argument("--replay", nargs="*", default=[], metavar="FILE[:FIRST-LAST]",
                   help="earlier rows to draw replay from, read in the order given")
    p.add_argument("--replay-ratio", type=float, default=4.0, help="replay rows per new row (default 4)")
    p.add_argument("--seed", type=int, default=0, help="seed of the draw and the shuffle")
    p.add_argument("--out", required=True, type=Path, help="the mix, jsonl (it must not exist)")
    args = p.parse_args(argv)
    try:
        if args.replay_ratio < 0:
            raise MixError(f"--replay-ratio must be >= 0, got {args.replay_ratio}")
        if args.out.exists():
            raise MixError(f"{args.out} exists: a mix is written once, give another --out")
        new = [row for spec in args.new for row in RowRange.parse(spec).read()]
        if not new:
            raise MixError("--new holds no rows")
        replay = [row for spec in args.replay for row in RowRange.parse(spec).read()]
        rows = mix_rows(new, replay, args.replay_ratio, args.seed)
    except MixError as e:
        sys.exit(f"error: {e}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(rows) + "\n", encoding="utf-8")
    print(f"{args.out}: {len(rows)} rows ({len(new)} new, {len(rows) - len(new)} replayed from {len(replay)})")


if __name__ == "__main__":
    main()
