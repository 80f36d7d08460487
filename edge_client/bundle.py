"""The edge bundle: what `export/to_onnx.py` writes and the edge loads, checked before anything runs.

A bundle is a directory:
    drafter.onnx         the draft step graph (ids, positions, SA cache, tree mask, memory rows | features)
    draft_vocab.npy      (reduced draft vocabulary only) the target-vocabulary id of each logit column
    tokenizer.json       the target's tokenizer (`tokenizers` format)
    chat_template.jinja  the target's chat template
    bundle.json          architecture, sizes, dtype, opset, protocol version, target name + fingerprint,
                         memory-row layout, cache shape, EOS ids, export checks, sha256 of every other file
`load_bundle` refuses a bundle with a missing or corrupt file, an unknown format or protocol version.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np

from edge_client.chat import ChatTemplate, ChatTokenizer
from moa_core.protocol import PROTOCOL_VERSION

BUNDLE_FILE = "bundle.json"
GRAPH_FILE = "drafter.onnx"
TOKENIZER_FILE = "tokenizer.json"
TEMPLATE_FILE = "chat_template.jinja"
VOCAB_FILE = "draft_vocab.npy"
PAYLOAD_FILES = (GRAPH_FILE, TOKENIZER_FILE, TEMPLATE_FILE)
FORMAT = "moa-edge-bundle"
FORMAT_VERSION = 1
KNOWN_PROTOCOL_VERSIONS = (PROTOCOL_VERSION,)
ARCHS = ("moa", "eagle")
REQUIRED_KEYS = ("format", "format_version", "arch", "dtype", "protocol_version", "target", "cache_shape",
                 "hidden_size", "vocab_size", "memory", "keeps_draft_cache", "tokenizer", "files")


class BundleError(ValueError):
    """The bundle cannot be used; the message names the file and what is wrong."""


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def file_records(directory: str | Path, names: Iterable[str] = PAYLOAD_FILES) -> dict[str, dict]:
    """{name: {sha256, bytes}} for the files of a bundle directory (what bundle.json's `files` holds)."""
    directory = Path(directory)
    return {n: {"sha256": sha256_file(directory / n), "bytes": (directory / n).stat().st_size} for n in names}


@dataclass(frozen=True)
class Bundle:
    """A validated bundle directory and its metadata."""

    path: Path
    meta: dict

    @property
    def arch(self) -> str:
        return self.meta["arch"]

    @property
    def dtype(self) -> str:
        return self.meta["dtype"]

    @property
    def fingerprint(self) -> str:
        """The target fingerprint the drafter was trained for (the server must report the same)."""
        return self.meta["target"]["fingerprint"]

    @property
    def target_name(self) -> str:
        return self.meta["target"]["name"]

    @property
    def cache_shape(self) -> tuple[int, int]:
        """(h_kv, head_dim) of the drafter's self-attention cache."""
        h, d = self.meta["cache_shape"]
        return int(h), int(d)

    @property
    def row_width(self) -> int:
        """Floats per memory row."""
        return int(self.meta["memory"]["row_width"])

    @property
    def hidden_size(self) -> int:
        return int(self.meta["hidden_size"])

    @property
    def agreement_topk(self) -> dict | None:
        """The drafter's held-out top-k agreement per depth ({width: [a_1, ..]}), when it has a training record."""
        return self.meta.get("agreement_topk")

    @property
    def keeps_draft_cache(self) -> bool:
        return bool(self.meta["keeps_draft_cache"])

    @property
    def eos_token_ids(self) -> list[int]:
        return [int(t) for t in self.meta["tokenizer"]["eos_token_ids"]]

    def draft_vocab(self) -> np.ndarray | None:
        """The reduced draft vocabulary (int64 ids, one per logit column), or None for the full vocabulary."""
        size = self.meta.get("draft_vocab_size", 0)
        if not size:
            return None
        ids = np.load(self.path / VOCAB_FILE, allow_pickle=False)
        if ids.shape != (size,) or ids.dtype.kind not in "iu" or ids.min() < 0 or ids.max() >= self.meta["vocab_size"]:
            raise BundleError(f"{self.path / VOCAB_FILE}: expected {size} ids in [0, {self.meta['vocab_size']}), "
                              f"got shape {ids.shape} {ids.dtype}")
        return ids.astype(np.int64)

    @property
    def graph_path(self) -> Path:
        return self.path / GRAPH_FILE

    def chat_tokenizer(self) -> ChatTokenizer:
        template = ChatTemplate((self.path / TEMPLATE_FILE).read_text(encoding="utf-8"),
                                self.meta["tokenizer"].get("special_tokens"))
        return ChatTokenizer(self.path / TOKENIZER_FILE, template, self.eos_token_ids)

    def describe(self) -> str:
        """One line for logs: architecture, dtype, target and fingerprint."""
        return (f"{self.arch} drafter ({self.dtype}) for {self.target_name}, fingerprint {self.fingerprint}, "
                f"protocol v{self.meta['protocol_version']}, {self.path}")


def _read_meta(path: Path) -> dict:
    meta_file = path / BUNDLE_FILE
    if not meta_file.is_file():
        raise BundleError(f"{meta_file}: missing (not an edge bundle; make one with `python -m export.to_onnx`)")
    try:
        meta = json.loads(meta_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BundleError(f"{meta_file}: not valid JSON ({e})") from None
    if not isinstance(meta, dict):
        raise BundleError(f"{meta_file}: expected a JSON object")
    missing = [k for k in REQUIRED_KEYS if k not in meta]
    if missing:
        raise BundleError(f"{meta_file}: missing keys {', '.join(missing)}")
    if meta["format"] != FORMAT or meta["format_version"] != FORMAT_VERSION:
        raise BundleError(f"{meta_file}: format {meta['format']!r} v{meta['format_version']} is not "
                          f"{FORMAT!r} v{FORMAT_VERSION}; re-export the bundle with this version")
    if meta["protocol_version"] not in KNOWN_PROTOCOL_VERSIONS:
        raise BundleError(f"{meta_file}: protocol version {meta['protocol_version']!r} is not supported by this "
                          f"edge client (supports {', '.join(map(str, KNOWN_PROTOCOL_VERSIONS))}); "
                          "re-export the bundle")
    if meta["arch"] not in ARCHS:
        raise BundleError(f"{meta_file}: unknown drafter architecture {meta['arch']!r} (expected one of {ARCHS})")
    if not meta["target"].get("fingerprint"):
        raise BundleError(f"{meta_file}: no target fingerprint")
    return meta


def load_bundle(path: str | Path, verify_hashes: bool = True) -> Bundle:
    """Open and validate a bundle directory; raise BundleError saying which file is wrong and how."""
    path = Path(path)
    if not path.is_dir():
        raise BundleError(f"{path}: no such bundle directory")
    meta = _read_meta(path)
    files = meta["files"]
    for name in PAYLOAD_FILES + ((VOCAB_FILE,) if meta.get("draft_vocab_size") else ()):
        if name not in files:
            raise BundleError(f"{path / BUNDLE_FILE}: lists no checksum for {name}")
    for name, record in files.items():
        if Path(name).name != name:
            raise BundleError(f"{path / BUNDLE_FILE}: file name {name!r} points outside the bundle")
        file = path / name
        if not file.is_file():
            raise BundleError(f"{file}: missing from the bundle")
        if file.stat().st_size != record["bytes"]:
            raise BundleError(f"{file}: {file.stat().st_size} bytes, bundle.json says {record['bytes']} (truncated "
                              "or replaced)")
        if verify_hashes and sha256_file(file) != record["sha256"]:
            raise BundleError(f"{file}: sha256 does not match bundle.json (the file is corrupt or was modified)")
    return Bundle(path, meta)
