"""Helpers for tests and examples: tiny random HF checkpoints built locally (no hub downloads)."""

from portable_rl.testing.tiny_checkpoint import char_tokenizer, make_tiny_checkpoint, TINY_SIZES

__all__ = ["char_tokenizer", "make_tiny_checkpoint", "TINY_SIZES"]
