"""The edge package and the core it shares never import torch or transformers (docs/design.md §8): every
edge_client and moa_core module is imported in a subprocess where both raise ImportError. (`tests.helpers.run_blocked`)."""

from __future__ import annotations

import pkgutil

import edge_client
import moa_core
from tests.helpers import run_blocked

def edge_modules() -> list[str]:
    packages = (edge_client, moa_core)
    return sorted(m.name for pkg in packages for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."))


def test_blocker_blocks():
    out = run_blocked("import torch")
    assert out.returncode != 0 and "blocked on the edge: torch" in out.stderr


def test_every_edge_module_imports_without_torch():
    modules = edge_modules()
    assert {"edge_client.bundle", "edge_client.runtime", "edge_client.chat", "moa_core.drafting",
            "moa_core.protocol", "moa_core.generation"} <= set(modules)
    code = "import importlib\n" + "".join(f"importlib.import_module({m!r})\n" for m in modules) + "print('ok')"
    out = run_blocked(code)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
