import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session", autouse=True)
def _threads():
    import torch

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module: a server's compute and the test's drafter share a small machine."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_moa(tiny):
    """A MoA drafter briefly trained on the tiny target (tests.helpers.train_tiny)."""
    from tests.helpers import train_tiny

    return train_tiny(tiny, "moa")


@pytest.fixture(scope="session")
def tiny():
    from models.tiny import tiny_target

    return tiny_target()


@pytest.fixture(scope="session")
def real_target_dir():
    """The cached copy of the real default target, converted from the wheel's GGUF first if this machine has none
    yet (once: later sessions find it), so that no test depends on another having loaded it before."""
    from pathlib import Path

    from models.target import resolve_target_path

    return Path(resolve_target_path("default"))


@pytest.fixture(scope="session")
def real_target():
    """The real default target (SmolLM2-135M-Instruct), loaded once per test session."""
    from models.registry import load_target

    return load_target("default")
