"""Where converted models, datasets and edge bundles are cached."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """`MOA_CACHE`, default ~/.cache/moa-edge (the server's converted target and the edge's bundles both live here)."""
    return Path(os.environ.get("MOA_CACHE", Path.home() / ".cache" / "moa-edge"))
