"""Text <-> token ids for prompts and responses, from an HF tokenizer directory.

`encode_prompt` optionally applies the tokenizer's chat template (instruct/base models in the real
recipes) and prepends BOS when the tokenizer defines one and the template does not add it.
`decode_response` drops the stop token and special tokens.

Multi-turn (rl/turns.py): `encode_messages` is the first prompt given as chat messages, and
`encode_observation` the ids of an environment's observation, tokenized once and appended after the model's
turn, ending where the model's next turn begins:

    chat template   the template's text between the end of an assistant turn (its EOS token) and the next
                    assistant turn's first token: "\n<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
                    for ChatML (role "user", or "tool" for templates that have it)
    plain           "\n{text}\n"  (a base model reads the observation as the next lines of the transcript)

A model turn that ended at max_tokens has no EOS; `after_eos=False` then starts the observation with one, so
the next turn still follows a closed one.

The tokenizer must fit the model: every token id < the model's `vocab_size` (config.json beside the
tokenizer, or `model_vocab_size`). A larger model vocabulary is normal (HF checkpoints pad it, e.g.
Qwen2.5: 151,665 tokens, vocab_size 152,064); a larger tokenizer is a `VocabularyMismatchError`, since
an embedding lookup past the table would silently read the wrong row (JAX clamps gather indices).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from portable_rl.errors import ConfigError, UserError


class VocabularyMismatchError(UserError, ValueError):
    """The tokenizer has token ids the model's embedding table does not have."""


def read_vocab_size(model_path: str | os.PathLike) -> int | None:
    """`vocab_size` from `model_path/config.json` (or its `text_config`), None when there is none."""
    config = Path(model_path) / "config.json"
    if not config.exists():
        return None
    d = json.loads(config.read_text())
    return d.get("vocab_size") or d.get("text_config", {}).get("vocab_size")


def check_vocabulary(tokenizer, vocab_size: int, tokenizer_path) -> None:
    """Raises `VocabularyMismatchError` when a token id of `tokenizer` is >= `vocab_size`."""
    ids = list(tokenizer.get_vocab().values()) + [i for i in tokenizer.all_special_ids if i is not None]
    needed = max(ids) + 1
    if needed > vocab_size:
        raise VocabularyMismatchError(
            f"tokenizer in {tokenizer_path} has token ids up to {needed - 1} ({len(tokenizer)} tokens) but the "
            f"model's vocab_size is {vocab_size}; point MODEL_PATH at a checkpoint whose tokenizer files match "
            f"its weights (or resize the model's embeddings to >= {needed})")


class TextCodec:
    def __init__(self, tokenizer_path: str | os.PathLike, *, chat_template: bool = False,
                 add_bos: bool = True, model_vocab_size: int | None = None):
        """`model_vocab_size`: the model's embedding rows (default: config.json in `tokenizer_path`)."""
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path))
        vocab_size = model_vocab_size or read_vocab_size(tokenizer_path)
        if vocab_size:
            check_vocabulary(self.tokenizer, vocab_size, tokenizer_path)
        self.chat_template = chat_template
        self.add_bos = add_bos and self.tokenizer.bos_token_id is not None
        self.eos_id = self.tokenizer.eos_token_id
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0

    def encode_prompt(self, text: str) -> list[int]:
        if self.chat_template:
            ids = self._chat_ids([{"role": "user", "content": text}])
        else:
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        return self._with_bos(ids)

    def _with_bos(self, ids) -> list[int]:
        if self.add_bos and (not ids or ids[0] != self.tokenizer.bos_token_id):
            ids = [self.tokenizer.bos_token_id] + list(ids)
        return list(ids)

    def _chat_ids(self, messages: list[dict]) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    def encode_messages(self, messages: list[dict]) -> list[int]:
        """Chat messages ([{"role": ..., "content": ...}]) → the prompt ids, ending with the assistant's turn."""
        if not self.chat_template:
            raise ConfigError("the environment's first prompt is chat messages but the run has no chat template; "
                              "set rl.RunConfig.chat_template = True (or have reset return text)")
        return self._with_bos(self._chat_ids(messages))

    def encode_observation(self, text: str, role: str = "user", *, after_eos: bool = True) -> list[int]:
        """An observation's ids (module doc), appended after a model turn; `after_eos=False`: that turn ended
        without EOS (max_tokens), so they start with one."""
        if self.chat_template:
            done = [{"role": "user", "content": "."}, {"role": "assistant", "content": "."}]
            before = self.tokenizer.apply_chat_template(done, tokenize=False)
            full = self.tokenizer.apply_chat_template(done + [{"role": role, "content": text}],
                                                      add_generation_prompt=True, tokenize=False)
            eos = self.tokenizer.eos_token
            cut = before.rfind(eos)
            if cut < 0 or not full.startswith(before):
                raise ConfigError(f"the chat template does not end an assistant turn with EOS {eos!r}, so an "
                                  f"observation cannot follow the model's turn as sampled; use chat_template=False")
            ids = self.tokenizer.encode(full[cut + len(eos):], add_special_tokens=False)
        else:
            ids = self.tokenizer.encode(f"\n{text}\n", add_special_tokens=False)
        return ([] if after_eos else [self.eos_id]) + list(ids)

    def encode_response(self, text: str) -> list[int]:
        """Target ids for supervised warm start: the answer followed by EOS."""
        return list(self.tokenizer.encode(text, add_special_tokens=False)) + [self.eos_id]

    def decode_response(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)
