"""Text <-> token ids for prompts and responses, from an HF tokenizer directory.

`encode_prompt` optionally applies the tokenizer's chat template (instruct/base models in the real
recipes) and prepends BOS when the tokenizer defines one and the template does not add it.
`decode_response` drops the stop token and special tokens.
"""

from __future__ import annotations

import os


class TextCodec:
    def __init__(self, tokenizer_path: str | os.PathLike, *, chat_template: bool = False,
                 add_bos: bool = True):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path))
        self.chat_template = chat_template
        self.add_bos = add_bos and self.tokenizer.bos_token_id is not None
        self.eos_id = self.tokenizer.eos_token_id
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0

    def encode_prompt(self, text: str) -> list[int]:
        if self.chat_template:
            ids = self.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                     add_generation_prompt=True, tokenize=True)
            ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        else:
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        if self.add_bos and (not ids or ids[0] != self.tokenizer.bos_token_id):
            ids = [self.tokenizer.bos_token_id] + list(ids)
        return list(ids)

    def encode_response(self, text: str) -> list[int]:
        """Target ids for supervised warm start: the answer followed by EOS."""
        return list(self.tokenizer.encode(text, add_special_tokens=False)) + [self.eos_id]

    def decode_response(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)
