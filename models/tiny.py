"""Tiny random Llama targets for tests and smoke runs: real transformers models, seconds to build."""

from __future__ import annotations

import torch

from models.target import Target

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer(vocab_size: int = 96):
    """A byte-level-ish tokenizer: special tokens, then single characters, then filler tokens up to vocab_size."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<|im_start|>", "<|im_end|>"]
    chars = list("abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,?!\n'")
    vocab = {t: i for i, t in enumerate((specials + chars)[:vocab_size])}
    for i in range(len(vocab), vocab_size):
        vocab[f"<t{i}>"] = i
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>",
                                   pad_token="<|im_end|>", additional_special_tokens=specials[1:])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_target(
    vocab_size: int = 96,
    n_layers: int = 3,
    hidden_size: int = 32,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    dtype: torch.dtype = torch.float64,
    seed: int = 0,
    family: str = "llama",
) -> Target:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    tok = tiny_tokenizer(vocab_size)
    cfg_cls, model_cls = (Qwen2Config, Qwen2ForCausalLM) if family == "qwen2" else (LlamaConfig, LlamaForCausalLM)
    config = cfg_cls(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                     num_hidden_layers=n_layers, num_attention_heads=n_heads, num_key_value_heads=n_kv_heads,
                     max_position_embeddings=512, tie_word_embeddings=True, eos_token_id=tok.eos_token_id,
                     pad_token_id=tok.eos_token_id, bos_token_id=None, attn_implementation="sdpa")
    model = model_cls(config).to(dtype)
    with torch.no_grad():  # sharper logits than the default init, so greedy paths have clear margins
        model.get_input_embeddings().weight.mul_(4.0)
    return Target(model.requires_grad_(False), tok, f"tiny-{family}-{seed}")
