"""requirements/gpu*.txt, the pinned GPU environments: every pin is one the adapters accept and pyproject's extras
allow, and the header's "ran on a GPU" versions are the ones the recorded GPU check reports."""

import json
import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from portable_rl.engines.sglang_internals import check_sglang_version
from portable_rl.engines.vllm_internals import check_vllm_version

REPO = Path(__file__).resolve().parent.parent
FILES = {"vllm": REPO / "requirements/gpu.txt", "sglang": REPO / "requirements/gpu-sglang.txt"}


def pins(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep and re.fullmatch(r"[\w.]+", version), f"{path.name}: {line!r} is not NAME==VERSION"
            out[name.lower()] = version
    return out


@pytest.mark.parametrize("engine", FILES)
def test_pins_are_what_the_adapters_and_extras_accept(engine):
    pinned = pins(FILES[engine])
    (check_vllm_version if engine == "vllm" else check_sglang_version)(pinned[engine])  # raises if refused
    assert ("sglang" if engine == "vllm" else "vllm") not in pinned  # their torch pins differ: one engine a venv
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for spec in extras[engine] + extras["ray"]:
        req = Requirement(spec)
        assert req.specifier.contains(Version(pinned[req.name.lower()])), (spec, pinned[req.name.lower()])
    assert pinned["jax"] == pinned["jaxlib"] == pinned["jax-cuda13-plugin"] == pinned["jax-cuda13-pjrt"]


def test_the_header_names_what_the_recorded_gpu_check_ran():
    header = FILES["vllm"].read_text()
    for run in sorted((REPO / "docs/data/gpu_check").glob("run*_gpu_check.json")):
        env = json.loads(run.read_text())["env"]
        assert f"Python {env['python']}" in header and f"jax / jaxlib {env['jax']}" in header, run.name
        assert f"torch {env['torch']}" in header, run.name
    assert pins(FILES["vllm"])["jax"] == env["jax"]  # the learner's JAX is the one that ran
