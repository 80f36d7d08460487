"""`make demo`: the main job on the default model.

Single device for now: SmolLM2-135M-Instruct with the shipped MoA drafter, streaming a greedy answer, then the
same prompt with vanilla decoding for comparison.
"""

from __future__ import annotations

import sys

import torch

PROMPT = "Explain in a few sentences why the sky is blue."


def main() -> None:
    from models.drafter import load_drafter
    from models.engine import SpeculativeEngine
    from models.target import load_target

    torch.set_num_threads(2)
    prompt = " ".join(sys.argv[1:]) or PROMPT
    target = load_target("default")
    engine = SpeculativeEngine(target, load_drafter("default", target), tree="auto")
    print(f"\n> {prompt}\n")
    spec = engine.generate(prompt, max_new_tokens=128, streamer=lambda s: print(s, end="", flush=True))
    vanilla = SpeculativeEngine(target, None).generate(prompt, max_new_tokens=128)
    s = spec.stats
    print(f"\n\nMoA: {s.new_tokens} tokens, tau {s.tau:.2f}, {s.tokens_per_s:.1f} tokens/s, "
          f"{s.target_forwards} target forwards (tree {s.tree})")
    print(f"vanilla: {vanilla.stats.tokens_per_s:.1f} tokens/s; same output: {vanilla.token_ids == spec.token_ids}")


if __name__ == "__main__":
    main()
