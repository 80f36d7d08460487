"""Where the shipped drafters live: `default` means the MoA drafter for the default target."""

from __future__ import annotations

from pathlib import Path

DEFAULTS_DIR = Path(__file__).resolve().parent / "default"
DEFAULT_DRAFTERS = {"default": "moa", "moa": "moa", "eagle": "eagle"}


def resolve_drafter_path(name_or_path: str | Path) -> Path:
    """`default` | `moa` | `eagle` -> the shipped drafter directory; anything else is a path."""
    key = str(name_or_path)
    if key in DEFAULT_DRAFTERS:
        path = DEFAULTS_DIR / DEFAULT_DRAFTERS[key]
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"the shipped {key} drafter is missing at {path} "
                                    "(train one: python -m models.train)")
        return path
    path = Path(name_or_path)
    if not path.is_dir():
        raise FileNotFoundError(f"unknown drafter {key!r}: not one of {', '.join(DEFAULT_DRAFTERS)} "
                                "and not a directory")
    return path
