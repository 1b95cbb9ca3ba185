"""Canaries for what the SGLang adapter assumes about SGLang (engines/sglang_internals.py), read from SGLang's
source: an installed sglang, or SGLANG_SRC=<wheel or unpacked dir> (SGLang needs CUDA, so on a CPU box its
wheel is read, never imported). Each internal is its own test and fails in one line naming the SGLang
version, the symbol and our file to change.
"""

import pytest

from portable_rl.engines.canary import PackageSource, Problem
from portable_rl.engines.sglang_internals import FLASH_RL_ARCHITECTURES, INTERNALS, check_internals
from sglang_api import find_source


@pytest.fixture(scope="module")
def sglang_source():
    where = find_source()
    if where is None:
        pytest.skip("no sglang source here (install sglang or set SGLANG_SRC to its wheel)")
    return PackageSource("sglang", where)


@pytest.mark.parametrize("internal", INTERNALS, ids=lambda i: i.name)
def test_sglang_source_has_the_internal(internal, sglang_source):
    what = internal.check(sglang_source)
    if what is not None:
        pytest.fail(str(Problem(internal, "SGLang", sglang_source.version(), what)), pytrace=False)


def test_a_new_flash_rl_model_is_reported_in_one_line(tmp_path):
    """A source whose models mark a third architecture for the flash_rl reload: the canary names it."""
    models = tmp_path / "sglang/srt/models"
    models.mkdir(parents=True)
    (tmp_path / "sglang/_version.py").write_text("__version__ = version = '9.9.9'\n")
    (tmp_path / "sglang/srt/configs").mkdir()
    (tmp_path / "sglang/srt/configs/load_config.py").write_text('FLASH_RL = "flash_rl"\n')
    for module, arch in [(m, a) for a, m in FLASH_RL_ARCHITECTURES.items()] + [("llama", "LlamaForCausalLM")]:
        (models / f"{module}.py").write_text(
            f"class {arch}:\n    def load_weights(self): ...\n    load_weights.supports_quantized_rl_reload = True\n")
    problems = {p.internal.name: p for p in check_internals(str(tmp_path))}
    line = str(problems["flash_rl_architectures"])
    assert line.startswith("SGLang 9.9.9: ") and "\n" not in line
    assert "LlamaForCausalLM (widen FLASH_RL_ARCHITECTURES)" in line
    assert "update portable_rl/engines/sglang_internals.py:FLASH_RL_ARCHITECTURES" in line
