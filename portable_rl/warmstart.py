"""Supervised warm start: a tiny random policy (or an HF checkpoint) trained briefly on a task's (prompt, answer) pairs.

    python -m portable_rl.warmstart --gin_file=gin/warmstart.gin [--gin.MODEL_PATH=DIR]

Loss: mean over answer tokens (answer + EOS) of −log π(y_t | prompt, y_<t) at T = 1. An example whose
`metadata["turns"]` holds chat turns (a multi-turn trace, e.g. `tasks.SqlTraceTask`) is laid out exactly as the
multi-turn driver lays out a trajectory (rl/turns.py): prompt, then per assistant turn its text + EOS (in the
loss), per other turn `codec.encode_observation(text, role)` (masked out of the loss). The run is stopped
early (a fixed number of steps) so the policy is a weak but not hopeless starting point for RL: greedy
accuracy is low while some of n samples are often right. Everything is deterministic from `seed`:
the random init (make_tiny_checkpoint), the data (task.train_batch(step, draw=0)), and the updates.
The result is an HF checkpoint directory (config.json, model.safetensors, tokenizer files), written
atomically, that vLLM and `convert.load_hf_model` both load.

`warmstart()` is a plain keyword-only function; gin fills its arguments, registered as `warmstart` by
`cli()` here and by train's CLI (the default run starts from it: `train.warmstart_fn = @warmstart`).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

from portable_rl.errors import ConfigError

WARMSTART_STREAM = 10_000_000  # task step offset: warm-start data never coincides with RL step data


def warmstart(*, output_dir: str, task, family: str = "qwen2", size: str = "tiny", steps: int = 250,
              batch_size: int = 64, learning_rate: float = 3e-3, seed: int = 0, max_positions: int = 64,
              warmup_steps: int = 30, schedule: str = "cosine", answer_noise: float = 0.0,
              noise_kind: str = "suffix", noise_suffix: str = "0", noise_offset: int = 1, progress: bool = True,
              size_overrides: Optional[dict] = None, snapshot_steps: Sequence[int] = (),
              base_model_path: Optional[str] = None, chat_template: bool = False) -> str:
    """Writes the warm-started HF checkpoint to `output_dir` and returns it.

    `answer_noise` > 0 imitates a sloppy teacher: the policy then puts most of its mass on the wrong form
    (greedy decoding is mostly wrong) while the right one keeps the rest (sampling often finds it): the
    situation RL with a verifiable reward is for.

    Args:
      output_dir: the HF checkpoint directory written (replaced if it exists).
      task: the task whose training (prompt, answer) pairs are shown (`tasks.*`); drawn from steps apart from
        the RL run's.
      family: the random model's architecture: "qwen2", "qwen3" or "llama".
      size: the dimension preset: "tiny" (hidden 128, 2 layers) or "small" (hidden 256, 4 layers).
      steps: supervised updates, one batch each.
      batch_size: (prompt, answer) pairs per update.
      learning_rate: the peak learning rate (AdamW, no weight decay, gradients clipped to global norm 1).
      seed: the seed of the random init, the data and the noise draws.
      max_positions: the model's max_position_embeddings: the longest prompt + answer in tokens.
      warmup_steps: updates of linear warmup; 0: none.
      schedule: "cosine" (decays to 0 at `steps`) or "constant", after the warmup.
      answer_noise: the fraction of answers shown with a consistent mistake (noise_kind); 0: none.
      noise_kind: "suffix" (noise_suffix appended: "85" → "850") or "offset" (the integer answer + noise_offset).
      noise_suffix: the text appended to a noisy answer with noise_kind "suffix".
      noise_offset: added to a noisy integer answer with noise_kind "offset".
      progress: show a progress bar.
      size_overrides: entries replacing the size preset's (e.g. {"num_hidden_layers": 1}); None: none.
      snapshot_steps: after each of these step counts also write `<output_dir>_step<k>` (with "constant", the
        first k steps equal a k-step run).
      base_model_path: an HF checkpoint to fine-tune (e.g. SmolLM2) instead of a random tiny model (`family`,
        `size`, `max_positions` and `size_overrides` then unused).
      chat_template: wrap prompts and observations in the tokenizer's chat template (the RL run's
        `rl.RunConfig.chat_template`: the warm start must produce the layout training samples).
    """
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from tqdm import tqdm

    from portable_rl.convert.hf import copy_tokenizer_files, load_hf_model, save_hf_model
    from portable_rl.learner_jax.logprobs import sequence_logprobs
    from portable_rl.learner_jax.optim import make_optimizer
    from portable_rl.learner_jax.step import make_train_step
    from portable_rl.rl.batching import pack_rollouts
    from portable_rl.rl.codec import TextCodec
    from portable_rl.convert.tiny_checkpoint import make_tiny_checkpoint

    if base_model_path and not (Path(base_model_path) / "config.json").exists():
        raise ConfigError(f"warmstart.base_model_path={base_model_path!r} holds no HF checkpoint; for SmolLM2 run "
                          f"python -m portable_rl.convert.gguf {base_model_path}")
    output_dir = Path(output_dir)
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=output_dir.parent) as tmp:
        init_dir = Path(base_model_path) if base_model_path else Path(tmp) / "init"
        if not base_model_path:
            make_tiny_checkpoint(init_dir, family, size=size, seed=seed, dtype="float32",
                                 max_positions=max_positions, **(size_overrides or {}))
        codec = TextCodec(init_dir, chat_template=chat_template)
        model, config = load_hf_model(init_dir, param_dtype=jnp.float32, compute_dtype=jnp.float32)
        tx = make_optimizer(learning_rate=learning_rate, warmup_steps=warmup_steps, total_steps=steps,
                            schedule=schedule, weight_decay=0.0, max_grad_norm=1.0)
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

        def loss_fn(model, batch):
            logp, _ = sequence_logprobs(model, batch["input_ids"], batch["attention_mask"], 1.0)
            mask = batch["response_mask"]                                       # [B, T]
            nll = -(logp * mask).sum() / jnp.maximum(mask.sum(), 1.0)
            return nll, {"nll": nll}

        train_step = make_train_step(loss_fn)
        bar = tqdm(range(steps), desc="warmstart", disable=not progress, dynamic_ncols=True)
        for step in bar:
            examples = task.train_batch(WARMSTART_STREAM + step, 0, batch_size)
            noisy = np.random.default_rng([seed, step, 99]).random(len(examples)) < answer_noise
            prompts = [codec.encode_prompt(e.prompt) for e in examples]
            answers, masks = [], []
            for e, n in zip(examples, noisy):
                if "turns" in e.metadata:
                    ids, mask = trace_ids(codec, e.metadata["turns"])
                else:
                    ids = codec.encode_response(_shown_answer(e.answer, noise_kind, noise_suffix, noise_offset)
                                                if n else e.answer)
                    mask = [1] * len(ids)
                answers.append(ids)
                masks.append(mask)
            batch = pack_rollouts(prompts, answers, [[0.0] * len(a) for a in answers], [0.0] * len(answers),
                                  pad_id=codec.pad_id, response_masks=masks)
            metrics = train_step(model, optimizer, batch)
            if step + 1 in snapshot_steps:
                snap = Path(f"{output_dir}_step{step + 1}")
                save_hf_model(model, config, snap, dtype="bfloat16", overwrite=True)
                copy_tokenizer_files(init_dir, snap)
            if step % 10 == 0 or step == steps - 1:
                bar.set_postfix(nll=f"{float(metrics['nll']):.3f}")
        staged = Path(tmp) / "out"
        save_hf_model(model, config, staged, dtype="bfloat16")
        copy_tokenizer_files(init_dir, staged)
        if output_dir.exists():
            shutil.rmtree(output_dir)
        staged.rename(output_dir)
    print(f"[warmstart] wrote {output_dir} ({steps} steps, {time.perf_counter() - t0:.0f}s)")
    return str(output_dir)


def trace_ids(codec, turns: Sequence[dict]) -> tuple[list[int], list[int]]:
    """Chat turns after the prompt → (response ids, loss mask) in the multi-turn driver's layout: an assistant turn
    is its text + EOS (mask 1, what the policy samples), any other turn an observation (mask 0)."""
    ids, mask = [], []
    for turn in turns:
        if turn["role"] == "assistant":
            part = codec.encode_response(turn["content"])
        else:
            part = codec.encode_observation(turn["content"], turn["role"])
        ids += part
        mask += [int(turn["role"] == "assistant")] * len(part)
    return ids, mask


def _shown_answer(answer: str, kind: str, suffix: str, offset: int) -> str:
    if kind == "suffix":
        return answer + suffix
    if kind != "offset":
        raise ConfigError(f"warmstart.noise_kind={kind!r}; use 'suffix' or 'offset'")
    try:
        return str(int(answer) + offset)
    except ValueError:
        raise ConfigError(f"warmstart.answer_noise with noise_kind='offset' needs integer answers, got {answer!r}; "
                          "set answer_noise=0 or noise_kind='suffix'") from None


def cli(argv=None):
    """Console entry point: parses --gin_file / --gin.NAME=VALUE flags and runs `warmstart`."""
    from portable_rl import gin_utils

    configured = gin_utils.register_configurable(warmstart, name="warmstart")
    gin_utils.run(configured, argv, description=__doc__.splitlines()[0])


if __name__ == "__main__":
    cli()
