"""Feature cache: one frozen target pass over a training split writes to disk what the drafters learn from, so that
training runs many epochs without the target.

    python -m models.features --data data/campaign          # writes data/campaign/features/
    python -m models.train ... --features data/campaign/features

Per token (fp16, memory-mapped `.npy` files): the target's last hidden state (EAGLE's input and both drafters'
feature target), every layer's post-RoPE key and value (MoA's LSA input; `--no-kv` leaves them out for EAGLE-only
caches) and the target's top-k next-token distribution (the CE term). `index.json` ties the cache to its
train.jsonl (sample ids, lengths, a digest) and records how it was made. Resumable: batches are written in order
and `progress.json` says how far it got.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from models.data import Encoded, load_encoded
from models.registry import load_target
from models.target import Target, TargetStep, autocast

INDEX = "index.json"
PROGRESS = "progress.json"


def data_digest(samples: list[Encoded]) -> str:
    h = hashlib.sha256()
    for s in samples:
        h.update(s.id.encode() + b"\0" + np.asarray(s.ids, dtype=np.int64).tobytes())
    return h.hexdigest()[:16]


def batches_in_order(lengths: list[int], tokens_per_batch: int) -> list[list[int]]:
    """Consecutive samples, as many as fit `tokens_per_batch` (padded) per batch."""
    out: list[list[int]] = [[]]
    for i, n in enumerate(lengths):
        if out[-1] and max(max(lengths[j] for j in out[-1]), n) * (len(out[-1]) + 1) > tokens_per_batch:
            out.append([])
        out[-1].append(i)
    return [b for b in out if b]


def build_cache(target: Target, samples: list[Encoded], out: Path, topk: int = 32, kv: bool = True,
                precision: str = "auto", tokens_per_batch: int = 4096) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    spec = target.spec
    lengths = [len(s.ids) for s in samples]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    n = offsets[-1]
    index = {"samples": len(samples), "tokens": n, "digest": data_digest(samples), "topk": topk, "kv": kv,
             "hidden_size": spec.hidden_size, "layers": spec.n_layers, "kv_width": spec.kv_width,
             "target": target.name, "target_fingerprint": target.fingerprint, "precision": precision,
             "offsets": offsets}
    files = {"hidden": ((n, spec.hidden_size), np.float16), "topk_ids": ((n, topk), np.int32),
             "topk_probs": ((n, topk), np.float16)}
    if kv:
        files |= {"keys": ((n, spec.n_layers, spec.kv_width), np.float16),
                  "values": ((n, spec.n_layers, spec.kv_width), np.float16)}
    progress_file = out / PROGRESS
    old = json.loads((out / INDEX).read_text()) if (out / INDEX).exists() else None
    resume = old is not None and {k: v for k, v in old.items() if k != "wall_s"} == {
        k: v for k, v in index.items() if k != "wall_s"} and progress_file.exists()
    arrays = {name: np.lib.format.open_memmap(out / f"{name}.npy", mode="r+" if resume else "w+", dtype=dt,
                                              shape=shape) for name, (shape, dt) in files.items()}
    (out / INDEX).write_text(json.dumps(index) + "\n")
    progress = json.loads(progress_file.read_text()) if resume else {"batches": 0, "wall_s": 0.0}
    batches = batches_in_order(lengths, tokens_per_batch)
    bar = tqdm(total=n, initial=sum(lengths[i] for b in batches[: progress["batches"]] for i in b),
               desc="features", unit="tok", unit_scale=True)
    t0 = time.time() - progress["wall_s"]
    for bi in range(progress["batches"], len(batches)):
        rows = [samples[i] for i in batches[bi]]
        t = max(len(s.ids) for s in rows)
        ids = torch.zeros(len(rows), t, dtype=torch.long)
        pad = torch.zeros(len(rows), t, dtype=torch.long)
        for r, s in enumerate(rows):
            ids[r, : len(s.ids)] = torch.tensor(s.ids)
            pad[r, : len(s.ids)] = 1
        with torch.no_grad(), autocast(precision, target.device, target.dtype):
            step = target.full_forward(ids.to(target.device), attention_mask=pad.to(target.device))
            probs, top = torch.softmax(target.lm_head(step.hidden).float(), -1).topk(topk, dim=-1)
        for r, i in enumerate(batches[bi]):
            a, b = offsets[i], offsets[i + 1]
            m = b - a
            arrays["hidden"][a:b] = step.hidden[r, :m].float().cpu().numpy()
            arrays["topk_ids"][a:b] = top[r, :m].cpu().numpy()
            arrays["topk_probs"][a:b] = probs[r, :m].cpu().numpy()
            if kv:
                arrays["keys"][a:b] = step.keys[r, :, :m].transpose(0, 1).float().cpu().numpy()
                arrays["values"][a:b] = step.values[r, :, :m].transpose(0, 1).float().cpu().numpy()
        progress = {"batches": bi + 1, "wall_s": round(time.time() - t0, 1)}
        if (bi + 1) % 20 == 0 or bi + 1 == len(batches):
            for arr in arrays.values():
                arr.flush()
            progress_file.write_text(json.dumps(progress) + "\n")
        bar.update(sum(len(s.ids) for s in rows))
    bar.close()
    index["wall_s"] = progress["wall_s"]
    (out / INDEX).write_text(json.dumps(index) + "\n")
    return index


@dataclass
class FeatureCache:
    """A built cache, opened read-only; `step(indices, t)` is the padded TargetStep of those training samples."""

    path: Path
    index: dict
    arrays: dict

    @classmethod
    def open(cls, path: str | Path, samples: list[Encoded], target: Target, need_kv: bool) -> "FeatureCache":
        path = Path(path)
        if not (path / INDEX).exists():
            raise FileNotFoundError(f"no feature cache at {path} (build it: python -m models.features --data DIR)")
        index = json.loads((path / INDEX).read_text())
        progress = json.loads((path / PROGRESS).read_text()) if (path / PROGRESS).exists() else {}
        if progress.get("batches") is None or "wall_s" not in index:
            raise ValueError(f"feature cache {path} is incomplete: rerun python -m models.features to finish it")
        if index["digest"] != data_digest(samples):
            raise ValueError(f"feature cache {path} was built for other training data (digest {index['digest']}, "
                             f"this split {data_digest(samples)})")
        if index["target_fingerprint"] != target.fingerprint:
            raise ValueError(f"feature cache {path} was made by target {index['target']!r} "
                             f"({index['target_fingerprint']}), not {target.name!r} ({target.fingerprint})")
        if need_kv and not index["kv"]:
            raise ValueError(f"feature cache {path} has no per-layer keys/values (built with --no-kv): MoA needs them")
        names = ["hidden", "topk_ids", "topk_probs"] + (["keys", "values"] if need_kv else [])
        return cls(path, index, {n: np.load(path / f"{n}.npy", mmap_mode="r") for n in names})

    def step(self, indices: list[int], t: int, device=None) -> TargetStep:
        offsets = self.index["offsets"]
        b = len(indices)
        out = {name: np.zeros((b, t) + arr.shape[1:], dtype=arr.dtype) for name, arr in self.arrays.items()}
        for r, i in enumerate(indices):
            a, e = offsets[i], min(offsets[i + 1], offsets[i] + t)
            for name, arr in self.arrays.items():
                out[name][r, : e - a] = arr[a:e]

        def tensor(name, dtype=torch.float32):
            return torch.from_numpy(out[name]).to(device=device, dtype=dtype)

        kv = "keys" in out
        return TargetStep(
            logits=None, hidden=tensor("hidden"),
            keys=tensor("keys").transpose(1, 2) if kv else None,
            values=tensor("values").transpose(1, 2) if kv else None,
            topk_ids=tensor("topk_ids", torch.long), topk_probs=tensor("topk_probs"),
        )


def main(argv: list[str] | None = None) -> None:
    from models.train import TrainConfig, prepare_data  # models.train imports this module

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="data directory with train.jsonl; built from --source when missing, "
                   "with the same split models.train makes")
    p.add_argument("--source", default="sharegpt", help="as models.train --source (when --data is missing)")
    p.add_argument("--heldout-source", default="", help="as models.train --heldout-source (when --data is missing)")
    p.add_argument("--max-len", type=int, default=TrainConfig.max_len, help="as models.train --max-len")
    p.add_argument("--n-heldout", type=int, default=TrainConfig.n_heldout, help="as models.train --n-heldout")
    p.add_argument("--out", default=None, help="cache directory (default: DATA/features)")
    p.add_argument("--target", default="default", help="target alias, HF id or path")
    p.add_argument("--topk", type=int, default=32, help="next-token candidates kept per position for the CE term")
    p.add_argument("--no-kv", action="store_true", help="leave out per-layer keys/values (EAGLE needs none)")
    p.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp32"],
                   help="auto: bf16 autocast where the hardware has bf16 matmuls, else fp32")
    p.add_argument("--tokens-per-batch", type=int, default=4096)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_target(args.target)
    prepare_data(TrainConfig(data=args.data, source=args.source, heldout_source=args.heldout_source,
                             max_len=args.max_len, n_heldout=args.n_heldout), target.tokenizer)
    samples = load_encoded(Path(args.data) / "train.jsonl")
    out = Path(args.out or Path(args.data) / "features")
    index = build_cache(target, samples, out, args.topk, not args.no_kv, args.precision, args.tokens_per_batch)
    print(f"feature cache {out}: {index['tokens']} tokens of {index['samples']} samples in {index['wall_s']} s")


if __name__ == "__main__":
    main()
