"""Names -> models: the targets and drafters a command line or a test can ask for.

`load_target("tiny[:SEED]")` is the small random Llama of `models.tiny` (tests, smoke runs); every other name goes
to the Hugging Face loader (`models.target.load_pretrained`). `build_drafter` / `load_drafter` make or load a MoA
or EAGLE drafter (`DRAFTERS`) for a target. The drafter and target modules import nothing from here.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from models.cpu_gemm import use_onednn
from models.defaults import resolve_drafter_path
from models.drafter import CONFIG_FILE, WEIGHTS_FILE, Drafter, FingerprintMismatch, OneDeviceOnly
from models.eagle import EagleDrafter
from models.moa import MoADrafter
from models.target import QUANTIZE, Target, TargetLoadError, load_pretrained

DRAFTERS: dict[str, type[Drafter]] = {"moa": MoADrafter, "eagle": EagleDrafter}
LOAD_ERRORS = (OSError, TargetLoadError, FingerprintMismatch, OneDeviceOnly)
"""What a missing file, an unknown target, a drafter of another target or a one-device drafter asked to serve edges
raise: a command line says `error: ...`."""


def load_target(name: str = "default", dtype: torch.dtype | str = torch.float32, device: str | torch.device = "cpu",
                attn_implementation: str = "sdpa", quantize: str = "none") -> Target:
    """A target by name: `tiny` or `tiny:SEED` (a small random Llama, for tests and smoke runs), else an alias,
    Hugging Face id or local path (nothing is fetched from a hub at run time).

    `quantize`: none, or int8 (int8 Linear layers, a float32 target on the CPU; see `Target.quantize_int8`)."""
    if quantize not in QUANTIZE:
        raise TargetLoadError(f"quantize must be one of {', '.join(QUANTIZE)}, got {quantize!r}")
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if name.startswith("tiny"):
        from models.tiny import tiny_target

        target = tiny_target(dtype=dtype, seed=int(name.split(":")[1]) if ":" in name else 0)
        target.model.to(device)
    else:
        target = load_pretrained(name, dtype, device, attn_implementation)
    if quantize == "int8":
        target.quantize_int8()
    return target


def read_drafter_config(path: str | Path) -> dict:
    path = Path(path)
    if not (path / CONFIG_FILE).exists():
        raise FileNotFoundError(f"no drafter at {path}: {CONFIG_FILE} is missing")
    return json.loads((path / CONFIG_FILE).read_text())


def build_drafter(arch: str, target: Target, **sizes) -> Drafter:
    """A fresh drafter of `arch` (moa | eagle) sized for `target`; `sizes` override config fields."""
    if arch not in DRAFTERS:
        raise ValueError(f"unknown drafter architecture {arch!r} (choose from {', '.join(DRAFTERS)})")
    cls = DRAFTERS[arch]
    config = cls.config_class.for_target(target.spec, **sizes)
    return cls(config, target).to(target.dtype)


def load_drafter(path: str | Path, target: Target, check_fingerprint: bool = True) -> Drafter:
    """Load a saved drafter (a directory, or `default` / `moa` / `eagle`: a shipped one) for `target`; refuse one
    trained for another target."""
    from safetensors.torch import load_file

    path = resolve_drafter_path(path)
    meta = read_drafter_config(path)
    if check_fingerprint and meta.get("target_fingerprint") != target.weights_fingerprint:
        raise FingerprintMismatch(
            f"drafter {path} was trained for target {meta.get('target')!r} (fingerprint "
            f"{meta.get('target_fingerprint')}), but the loaded target is {target.name!r} "
            f"(fingerprint {target.weights_fingerprint})"
        )
    cls = DRAFTERS[meta["arch"]]
    drafter = cls(cls.config_class(**meta["config"]), target).to(device=target.device, dtype=target.dtype)
    if meta.get("draft_vocab_size"):
        drafter.set_draft_vocab(torch.arange(meta["draft_vocab_size"]))  # the real ids come with the weights
    state = load_file(str(Path(path) / WEIGHTS_FILE))
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    missing = [k for k in missing if Drafter.is_own(k)]
    if missing or unexpected:
        raise ValueError(f"drafter weights at {path} do not fit its config: missing {missing}, unexpected {unexpected}")
    drafter.training_record = meta.get("training")
    if drafter.draft_vocab is not None:
        drafter.set_draft_vocab(drafter.draft_vocab)
    drafter = drafter.to(device=target.device, dtype=target.dtype).eval().requires_grad_(False)
    if drafter.embed.weight.device.type == "cpu":
        use_onednn(drafter)
    return drafter
