"""The RL loop's pieces, one concept per file (gin-free; the entry points wire them).

- `codec`: text <-> token ids for prompts and responses (an HF tokenizer directory).
- `turns`: the rollout driver: trajectories of turns between the engine and an environment, tokens in and out.
- `scoring`: examples → environments → scored trajectories, shared by training and evaluation.
- `rollout`: one step's draws of scored groups → dynamic sampling, with the rollout stats.
- `async_rollout`: the same one step ahead, overlapping the learner (one-step off-policy).
- `dynamic_sampling`: keep prompt groups whose rewards are not all equal (DAPO).
- `config`: the loop's settings, one small config per concern (generation, data, shapes, loss, safety,
  environment).
- `dapo`: `DapoConfig` (the union of those configs, gin's names; `dapo_config` from flat names), advantages
  and the training batch.
- `batching`: rollouts → `[B, T]` rows (packed or one per row) with a response mask; micro-batches.
- `learner`: old logprobs, rollout correction, mini-batch updates (the learner side of a step).
- `served_view`: the learner's forwards on the weights the engine serves (its quantizer, SmoothQuant).
- `sync`: weight push (learner → engine) and what the engine serves (`Serving`).
- `diagnostics`: what is measured after each push: `update_survival` (how much of the update the served
  weights received), the post-sync probe (engines/probe.py), `mismatch_split` (the probe's KL by source).
- `evaluation`: held-out accuracy, pass@k and mean length through an engine.
- `metrics`: metrics.jsonl + TensorBoard writer (resumable); `plots`: PNG curves.
- `preemption`: stop cleanly on SIGTERM (finish the step, checkpoint).
- `roles`: what a process does in the loop: the engine side (the driver) or a follower.
- `multihost`: the collectives of several JAX processes (broadcast from the driver, stop, barriers).
- `colocation`: learner and engine on one device: the memory plan (decided before JAX starts) and time-sharing.
"""
