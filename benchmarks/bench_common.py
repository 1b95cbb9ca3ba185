"""Shared pieces of the benchmark scripts: median timing, the child side of interleaved timing, result files
and the random Qwen2 checkpoints they measure."""

import argparse
import json
import os
import statistics
import time


def timed(fn, repeats: int) -> float:
    """Median wall time of `repeats` calls (after one warm-up call)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def serve_timed_steps(conn, step) -> None:
    """Child side of an interleaved timing: for each "step" the parent sends, run `step()` and send back
    its wall time; any other message ends the loop."""
    while conn.recv() == "step":
        start = time.perf_counter()
        step()
        conn.send(time.perf_counter() - start)


def write_json(out_dir: str, name: str, result: dict) -> str:
    """Writes (or rewrites) out_dir/name and returns its path; the device checks call it after every part,
    so a timeout keeps what has finished."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    return path


def add_model_size_args(parser: argparse.ArgumentParser, *, layers: int, hidden: int, intermediate: int,
                        heads: int, vocab: int = 32000) -> None:
    parser.add_argument("--layers", type=int, default=layers)
    parser.add_argument("--hidden", type=int, default=hidden)
    parser.add_argument("--intermediate", type=int, default=intermediate)
    parser.add_argument("--heads", type=int, default=heads)
    parser.add_argument("--vocab", type=int, default=vocab)


def random_qwen2_checkpoint(path: str, args) -> str:
    """Writes (once) a random untied Qwen2 HF checkpoint of the size in `args` (add_model_size_args)."""
    from portable_rl.convert.tiny_checkpoint import make_tiny_checkpoint

    if not os.path.exists(os.path.join(path, "config.json")):
        make_tiny_checkpoint(path, "qwen2", vocab_size=args.vocab, hidden_size=args.hidden,
                             intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                             num_attention_heads=args.heads, num_key_value_heads=args.heads,
                             head_dim=args.hidden // args.heads, tie_word_embeddings=False, max_positions=512)
    return path
