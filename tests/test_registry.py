"""Engine registry: the decorator, the unknown-name error, and an out-of-tree package via entry points."""

import math
import shutil
import subprocess
import sys
import importlib
from pathlib import Path

import pytest
import torch

from portable_rl.engines import EngineAdapter, SamplingConfig, available_engines, create_engine, register
from portable_rl.engines import registry

FIXTURE = Path(__file__).parent / "fixtures" / "oot_engine"


class _Echo(EngineAdapter):
    """Repeats the prompt's last token; logprob 0 (a deterministic engine)."""

    quantization = None

    def __init__(self, *, repeat=2):
        self.repeat = repeat

    def generate(self, prompt_token_ids, sampling):
        from portable_rl.engines import Rollout

        return [Rollout(i, list(p), [p[-1]] * self.repeat, [0.0] * self.repeat, "length")
                for i, p in enumerate(prompt_token_ids) for _ in range(sampling.n)]

    def update_weights(self, named_tensors):
        pass

    def close(self):
        pass


@pytest.fixture
def clean_registry():
    saved = dict(registry._REGISTRY)
    yield
    registry._REGISTRY.clear()
    registry._REGISTRY.update(saved)


def test_builtins_are_listed_without_importing_engines():
    assert {"vllm", "sglang"} <= set(available_engines())
    # In a fresh interpreter: listing registers the adapters but imports no engine (vllm is installed here).
    code = ("import sys; from portable_rl.engines import available_engines; names = available_engines(); "
            "assert 'vllm' in names and 'vllm' not in sys.modules and 'sglang' not in sys.modules, names")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_register_decorator_and_factory(clean_registry):
    register("echo_test")(_Echo)
    with create_engine("echo_test", repeat=3) as engine:
        rollouts = engine.generate([[4, 5], [6]], SamplingConfig(n=2))
    assert [r.response_token_ids for r in rollouts] == [[5, 5, 5]] * 2 + [[6, 6, 6]] * 2
    assert [r.prompt_index for r in rollouts] == [0, 0, 1, 1]
    with pytest.raises(ValueError, match="already registered"):
        register("echo_test")(type("Other", (_Echo,), {}))


def test_unknown_engine_lists_known_ones():
    with pytest.raises(KeyError) as info:
        create_engine("no_such_engine")
    message = str(info.value)
    assert "no_such_engine" in message and "vllm" in message and "sglang" in message
    assert "portable_rl.engines" in message  # tells how to register one


def test_adapter_must_report_quantization(clean_registry):
    """`quantization` is part of the contract (engines/base.py): an adapter without it is refused, closed."""
    closed = []

    class Unreported(_Echo):
        def close(self):
            closed.append(True)

    del _Echo.quantization
    try:
        register("unreported_test")(Unreported)
        with pytest.raises(TypeError, match="does not report `quantization`: set it in the adapter"):
            create_engine("unreported_test")
        assert closed == [True]
    finally:
        _Echo.quantization = None
    assert create_engine("unreported_test").quantization is None  # inherited from _Echo again


def test_factory_must_build_an_adapter(clean_registry):
    register("not_an_adapter")(lambda: object())
    with pytest.raises(TypeError, match="not an EngineAdapter"):
        create_engine("not_an_adapter")


@pytest.fixture
def installed_oot_package(tmp_path, clean_registry):
    """Builds and installs tests/fixtures/oot_engine into a temp dir on sys.path (the venv is untouched)."""
    src = tmp_path / "src_pkg"
    shutil.copytree(FIXTURE, src)
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--no-index", "--target", str(target), str(src)], check=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(target))  # also invalidates the import caches
        yield target
    # "uninstall": the directory left sys.path, so the distribution and its entry point disappear
    for name in [m for m in sys.modules if m.startswith("toy_bigram_engine")]:
        del sys.modules[name]
    importlib.invalidate_caches()


def test_out_of_tree_engine_through_entry_point(installed_oot_package):
    assert "toy_bigram" in available_engines()
    sampling = SamplingConfig(temperature=0.5, max_tokens=6, n=2, seed=11)
    with create_engine("toy_bigram", vocab_size=5, seed=3) as engine:
        assert type(engine).__module__ == "toy_bigram_engine.engine"
        rollouts = engine.generate([[1, 2], [4]], sampling)
        assert [r.prompt_index for r in rollouts] == [0, 0, 1, 1]
        # Its logprobs are log_softmax(table[prev] / T)[token]; recompute them independently.
        table = torch.tensor(engine.table, dtype=torch.float64)
        for r in rollouts:
            prev = [r.prompt_token_ids[-1]] + r.response_token_ids[:-1]
            expected = torch.log_softmax(table[prev] / 0.5, dim=-1)[range(len(prev)), r.response_token_ids]
            assert r.response_logprobs == pytest.approx(expected.tolist(), abs=1e-9)
        # Pushed weights take effect: a table that makes token 3 certain after anything.
        new_table = torch.full((5, 5), -30.0)
        new_table[:, 3] = 30.0
        engine.update_weights(iter([("table", new_table)]))  # the flat push
        after = engine.generate([[1, 2]], sampling)
        assert all(r.response_token_ids == [3] * 6 for r in after)
        assert all(math.isclose(lp, 0.0, abs_tol=1e-9) for r in after for lp in r.response_logprobs)
    assert engine.closed


def test_out_of_tree_engine_gone_after_uninstall(tmp_path, clean_registry):
    assert "toy_bigram" not in available_engines()
