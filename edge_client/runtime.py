"""The drafter on ONNX Runtime: `OrtDraftStep` is the edge's `DraftStep` (see moa_core.drafting).

Execution providers: "auto" takes CUDA when onnxruntime-gpu offers it, else the CPU; a list (or "cpu",
"cuda", "tensorrt") asks for specific ones, each falling back to the next and finally to the CPU.
`OrtDraftStep.provider` says which one runs the graph.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import onnxruntime as ort

from edge_client.bundle import Bundle, load_bundle

CPU = "CPUExecutionProvider"
PROVIDER_ALIASES = {"cpu": [CPU], "cuda": ["CUDAExecutionProvider", CPU],
                    "tensorrt": ["TensorrtExecutionProvider", "CUDAExecutionProvider", CPU]}
AUTO_ORDER = ("CUDAExecutionProvider", CPU)
OUTPUTS = ("logits", "out_features", "present_k", "present_v")


def choose_providers(providers: str | Sequence[str] = "auto") -> list[str]:
    """Execution providers to ask ONNX Runtime for, best first; unknown or unavailable ones are an error."""
    available = ort.get_available_providers()
    if providers == "auto":
        return [p for p in AUTO_ORDER if p in available]
    wanted = PROVIDER_ALIASES.get(providers, [providers]) if isinstance(providers, str) else list(providers)
    missing = [p for p in wanted if p not in available]
    if missing:
        raise ValueError(f"execution provider(s) {', '.join(missing)} not available in this onnxruntime "
                         f"(available: {', '.join(available)}; CUDA/TensorRT need onnxruntime-gpu)")
    return wanted if CPU in wanted else [*wanted, CPU]


class OrtDraftStep:
    """One draft step on ONNX Runtime, numpy in and out, with the `DraftStep` signature (batch size 1)."""

    def __init__(self, bundle: Bundle | str | Path, providers: str | Sequence[str] = "auto",
                 threads: int | None = None):
        self.bundle = bundle if isinstance(bundle, Bundle) else load_bundle(bundle)
        self.arch = self.bundle.arch
        self.keeps_draft_cache = self.bundle.keeps_draft_cache
        self.cache_shape = self.bundle.cache_shape
        self.draft_vocab = self.bundle.draft_vocab()
        self.vocab_size = self.bundle.meta["vocab_size"]
        options = ort.SessionOptions()
        # no busy-waiting between steps: the edge waits on the network between rounds, and spinning threads would
        # burn the battery (and, with the server on the same machine, its CPU)
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        if threads:
            options.intra_op_num_threads = threads
            options.inter_op_num_threads = 1
        self.session = ort.InferenceSession(str(self.bundle.graph_path), options,
                                            providers=choose_providers(providers))
        self.provider = self.session.get_providers()[0]
        self._extra = "memory" if self.arch == "moa" else "features"

    def __call__(self, ids, positions, past_k, past_v, mask, memory, features):
        extra = memory if self.arch == "moa" else features
        feeds = {
            "ids": np.asarray(ids, dtype=np.int64)[None],
            "positions": np.asarray(positions, dtype=np.int64)[None],
            "past_k": np.asarray(past_k, dtype=np.float32)[None],
            "past_v": np.asarray(past_v, dtype=np.float32)[None],
            "mask": np.asarray(mask, dtype=np.float32)[None, None],
            self._extra: np.asarray(extra, dtype=np.float32)[None],
        }
        return tuple(x[0] for x in self.session.run(OUTPUTS, feeds))
