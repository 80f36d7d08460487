"""Average drafters trained side by side from one drafter on disjoint shards of data (local SGD, one round).

A leg of `models.train` runs on one CPU core and barely gains from a second thread. So on a machine with N cores
(or on N machines) run N legs from the same `--init` drafter at once, each on its own shard of the data, and
average what they learned: the weights, weighted by the tokens each leg saw. The average goes into the training
record as one leg that saw all the shards' tokens, and is scored on the legs' own held-out answers (eval.json, as
a training run writes, for `models.evaluate.paired_difference`). Legs that did not start from the same drafter,
or were scored on different answers, are refused.

    head -n 7600 data/mix.jsonl > data/mix_a.jsonl; tail -n +7601 data/mix.jsonl > data/mix_b.jsonl
    python -m models.train --init moa --data data/a --source data/mix_a.jsonl --seed 1 --out runs/a ... &
    python -m models.train --init moa --data data/b --source data/mix_b.jsonl --seed 2 --out runs/b ... &
    wait; python -m models.average runs/a runs/b --out runs/ab
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from models.data import load_encoded
from models.evaluate import chain_agreement
from models.drafter import CONFIG_FILE, RECORD_FILE, WEIGHTS_FILE
from models.registry import LOAD_ERRORS, load_drafter, load_target, read_drafter_config
from models.train import record_of_legs


class CannotAverage(ValueError):
    """The drafters are not legs from one drafter scored alike."""


def last_legs(metas: list[dict]) -> list[dict]:
    """Each drafter's own leg, after checking that all continue the same drafter for the same target."""
    records = [m.get("training") or {} for m in metas]
    if any(not r.get("legs") for r in records):
        raise CannotAverage("each drafter needs a training record with its legs (trained by models.train)")
    for key in ("arch", "target_fingerprint", "draft_vocab_size", "config"):
        if len({json.dumps(m.get(key), sort_keys=True) for m in metas}) > 1:
            raise CannotAverage(f"the drafters differ in {key}: they are not legs of one drafter")
    if len({json.dumps(r["legs"][:-1], sort_keys=True) for r in records}) > 1:
        raise CannotAverage("the drafters did not start from the same drafter (their earlier legs differ)")
    legs = [r["legs"][-1] for r in records]
    if len({json.dumps(scored_on(leg)) for leg in legs}) > 1:
        raise CannotAverage("the legs were scored on different held-out answers: "
                            + "; ".join(str(scored_on(leg)) for leg in legs))
    return legs


def scored_on(leg: dict) -> dict:
    """What a leg's final evaluation scored: its held-out split (ids) and how many answers."""
    split = Path(leg["data"]["dir"]) / "split.json"
    ids = json.loads(split.read_text())["heldout_ids"] if split.exists() else None
    return {"heldout_source": leg["data"].get("heldout_source"), "heldout_ids": ids,
            "samples": leg["config"]["final_eval_samples"], "max_len": leg["config"]["max_len"]}


def average_weights(paths: list[Path], weights: list[float]) -> dict[str, torch.Tensor]:
    """The weighted mean of the drafters' float tensors (in fp32, stored back in their dtype); the others (e.g.
    the draft vocabulary's ids) must be equal."""
    from safetensors.torch import load_file

    states = [load_file(str(p / WEIGHTS_FILE)) for p in paths]
    if len({tuple(sorted(s)) for s in states}) > 1:
        raise CannotAverage("the drafters' weights have different tensors")
    total = sum(weights)
    out = {}
    for name, first in states[0].items():
        if first.is_floating_point():
            mean = sum(s[name].float() * (w / total) for s, w in zip(states, weights))
            out[name] = mean.to(first.dtype)
        elif all(torch.equal(s[name], first) for s in states[1:]):
            out[name] = first
        else:
            raise CannotAverage(f"the drafters' {name} differ (not a float tensor: cannot average it)")
    return out


def merged_record(record: dict, legs: list[dict], heldout: dict) -> dict:
    """The first drafter's record with its last leg replaced by one leg that saw all the shards' tokens; the legs
    ran side by side, so its wall time is the longest one's."""
    leg = {"average_of": legs, "init": legs[0]["init"], "data": {**legs[0]["data"], "dir": None, "source": None},
           "tokens": sum(x["tokens"] for x in legs), "steps": sum(x["steps"] for x in legs),
           "wall_time_s": max(x["wall_time_s"] for x in legs),
           "hardware": {**legs[0]["hardware"], "workers": len(legs)},
           "config": {**legs[0]["config"], "average": "weights weighted by each leg's tokens"},
           "heldout": heldout}
    return {**record, **record_of_legs(record["legs"][:-1] + [leg]), "heldout": heldout}


def drafter_dir(path: str) -> Path:
    """A training output directory (its drafter/) or a drafter directory."""
    p = Path(path)
    return p / "drafter" if (p / "drafter" / CONFIG_FILE).exists() else p


def average(paths: list[str], out: Path, target_name: str = "default") -> dict:
    """Average the drafters at `paths` into out/drafter, score it, and return its held-out evaluation."""
    if len(paths) < 2:
        raise CannotAverage("give at least two drafters to average")
    dirs = [drafter_dir(p) for p in paths]
    metas = [read_drafter_config(d) for d in dirs]
    legs = last_legs(metas)
    state = average_weights(dirs, [leg["tokens"] for leg in legs])
    heldout_file = Path(legs[0]["data"]["dir"]) / "heldout.jsonl"
    if not heldout_file.exists():
        raise CannotAverage(f"the legs' held-out split is not at {heldout_file} (their --data directory)")
    target = load_target(target_name)
    if metas[0]["target_fingerprint"] != target.weights_fingerprint:
        raise CannotAverage(f"the drafters were trained for target {metas[0]['target']!r}, not {target.name!r}")
    cfg = legs[0]["config"]
    heldout = load_encoded(heldout_file)[: cfg["final_eval_samples"]]
    drafter_out = out / "drafter"
    drafter_out.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    save_file(state, str(drafter_out / WEIGHTS_FILE))
    (drafter_out / CONFIG_FILE).write_text(json.dumps(metas[0], indent=2) + "\n")  # the record follows the score
    ev = chain_agreement(load_drafter(drafter_out, target), target, heldout, max_len=cfg["max_len"])
    (out / "eval.json").write_text(json.dumps(ev) + "\n")
    ev = {k: v for k, v in ev.items() if k != "per_answer"}
    record = merged_record(metas[0]["training"], legs, ev)
    (drafter_out / CONFIG_FILE).write_text(json.dumps({**metas[0], "training": record}, indent=2) + "\n")
    (drafter_out / RECORD_FILE).write_text(json.dumps(record, indent=2) + "\n")
    return record


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("drafters", nargs="+", help="training output directories (models.train --out) or drafter dirs")
    p.add_argument("--out", required=True, help="output directory: drafter/ (fp16 as the legs) and eval.json")
    p.add_argument("--target", default="default", help="target alias, HF id or local path")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads for the held-out evaluation")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    try:
        record = average(args.drafters, Path(args.out), args.target)
    except (CannotAverage, *LOAD_ERRORS) as e:
        sys.exit(f"error: {e}")
    leg = record["legs"][-1]
    print(json.dumps({"drafters": len(leg["average_of"]), "tokens": leg["tokens"], **record["heldout"]}))
    return record


if __name__ == "__main__":
    main()
