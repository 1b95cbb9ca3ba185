"""The RL loop's pieces, one concept per file (gin-free; the entry points wire them).

- `batching`: rollouts → right-padded `[B, T]` arrays with a response mask, T bucketed.
- `dynamic_sampling`: keep prompt groups whose rewards are not all equal (DAPO).
- `scoring`: decode responses and score them with a registered reward.
- `evaluation`: held-out accuracy, pass@k and mean length through an engine.
- `metrics`: metrics.jsonl + TensorBoard writer (resumable); `plots`: PNG curves.
- `dapo`: the algorithm settings and one training step.
"""
