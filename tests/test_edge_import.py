"""The edge package and the core it shares never import torch or transformers (docs/design.md §8): every
edge_client and moa_core module is imported in a subprocess where both raise ImportError. `run_blocked` is reusable for other edge-only checks."""

from __future__ import annotations

import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import edge_client
import moa_core

ROOT = Path(__file__).resolve().parents[1]
BLOCKED = ("torch", "transformers")

BLOCKER = f"""
import sys
class _Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {BLOCKED!r}:
            raise ImportError("blocked on the edge: " + name)
sys.meta_path.insert(0, _Block())
"""


def run_blocked(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter where importing torch or transformers raises ImportError."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    script = BLOCKER + code + f"\nassert not {{m.split('.')[0] for m in sys.modules}} & set({BLOCKED!r})\n"
    return subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


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
