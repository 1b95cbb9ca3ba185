"""Tiny random Hugging Face checkpoints, written locally with transformers.

Nothing is downloaded: the model is randomly initialised by transformers and the tokenizer is a
character-level tokenizer (every printable ASCII character is one token) built with `tokenizers`.
The directory is a normal HF checkpoint (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json) that transformers, vLLM and `portable_rl.convert.load_hf_model` all load.
"""

from __future__ import annotations

import os
import string
from typing import Any

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")
# Printable ASCII minus the whitespace control characters; space is kept.
CHARS = tuple(c for c in string.printable if c not in "\t\n\r\x0b\x0c")
CHAR_VOCAB_SIZE = len(SPECIAL_TOKENS) + len(CHARS)  # 98

# Head dim 32: vLLM's CPU attention supports head sizes that are multiples of 32.
TINY_SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32),
    "small": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=32),
}


def char_tokenizer():
    """A `transformers.PreTrainedTokenizerFast` with one token per printable ASCII character."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARS)}
    # BPE without merges splits a word into characters; Split isolates every character.
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
        model_max_length=4096, clean_up_tokenization_spaces=False)


def _hf_config(family: str, vocab_size: int, size: dict[str, Any], max_positions: int,
               tie_word_embeddings: bool, pad_id: int, bos_id: int, eos_id: int):
    import transformers

    common = dict(vocab_size=vocab_size, max_position_embeddings=max_positions,
                  tie_word_embeddings=tie_word_embeddings, rms_norm_eps=1e-6,
                  pad_token_id=pad_id, bos_token_id=bos_id, eos_token_id=eos_id, **size)
    if family == "qwen2":
        return transformers.Qwen2Config(rope_theta=1_000_000.0, **common)
    if family == "qwen3":
        return transformers.Qwen3Config(rope_theta=1_000_000.0, **common)
    if family == "llama":
        return transformers.LlamaConfig(
            rope_theta=500_000.0, attention_bias=False, mlp_bias=False,
            rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                              high_freq_factor=4.0, original_max_position_embeddings=64),
            **common)
    # MoE: 4 experts, top-2 (`overrides` change any of these, e.g. num_experts=6, norm_topk_prob=True).
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=size["intermediate_size"] // 4)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(rope_theta=1_000_000.0, **{**moe, **common})
    if family == "qwen2_moe":
        moe["shared_expert_intermediate_size"] = size["intermediate_size"] // 2
        return transformers.Qwen2MoeConfig(rope_theta=1_000_000.0, **{**moe, **common})
    raise ValueError(f"unknown family {family!r}; expected one of: qwen2, qwen3, llama, qwen3_moe, qwen2_moe")


def min_vocab_size(family: str) -> int:
    """Token ids the written tokenizer has once loaded: transformers loads a qwen2 checkpoint's
    tokenizer as `Qwen2Tokenizer`, which appends its unk token <|endoftext|> as id 98."""
    return CHAR_VOCAB_SIZE + (family == "qwen2")


def make_tiny_checkpoint(path: str | os.PathLike, family: str = "qwen2", *, size: str = "tiny",
                         seed: int = 0, dtype: str = "bfloat16", vocab_size: int = 128,
                         max_positions: int = 512, tie_word_embeddings: bool | None = None,
                         init_std: float = 0.02, **overrides: Any) -> str:
    """Writes a random `family` checkpoint (qwen2 | qwen3 | llama | qwen3_moe | qwen2_moe) to `path` and
    returns the path.

    `vocab_size` may exceed the tokenizer's tokens (real checkpoints pad their vocab too) but not be
    below them: 98, or 99 for qwen2 (see `min_vocab_size`).
    `overrides` replace entries of the size preset (e.g. num_hidden_layers=1).
    """
    import torch
    import transformers

    smallest = min_vocab_size(family)
    if vocab_size < smallest:
        raise ValueError(f"vocab_size={vocab_size} is smaller than the {smallest} tokens a {family} "
                         f"checkpoint's tokenizer loads with; use vocab_size >= {smallest}")
    if size not in TINY_SIZES:
        raise ValueError(f"unknown size {size!r}; expected one of {sorted(TINY_SIZES)}")
    dims = {**TINY_SIZES[size], **overrides}
    tie = (family == "qwen2") if tie_word_embeddings is None else tie_word_embeddings
    tokenizer = char_tokenizer()
    config = _hf_config(family, vocab_size, dims, max_positions, tie,
                        tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id)
    config.initializer_range = init_std
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # random norm gains and biases so parity tests exercise them
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.02 * torch.randn_like(p))
    model = model.to(getattr(torch, dtype))
    model.config.dtype = dtype
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    generation_config = os.path.join(path, "generation_config.json")
    if os.path.exists(generation_config):  # keeps engines from picking up sampling defaults
        os.remove(generation_config)
    return str(path)
