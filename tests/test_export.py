"""`portable_rl.export`: a run's orbax step becomes an HF checkpoint holding exactly the trained params."""

import os
import pathlib
import shutil

import jax
import jax.numpy as jnp
import pytest
import transformers
from flax import nnx

from portable_rl.convert import load_hf_model
from portable_rl.convert.tiny_checkpoint import make_tiny_checkpoint
from portable_rl.errors import UserError
from portable_rl.export import export, main
from portable_rl.learner_jax.checkpoint import Checkpointer


def params(model):
    return jax.tree.leaves(nnx.state(model, nnx.Param))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run directory with steps 3 and 5, each with params moved away from the base checkpoint."""
    root = tmp_path_factory.mktemp("export")
    base = pathlib.Path(make_tiny_checkpoint(root / "base", "qwen2"))
    model, _ = load_hf_model(base)
    trained = {}
    with Checkpointer(root / "run" / "checkpoints") as ckpts:
        for step in (3, 5):
            state = nnx.state(model, nnx.Param)
            nnx.update(model, jax.tree.map(lambda p: p + 1e-3 * step * jnp.sign(p) + 1e-7, state))
            trained[step] = [jnp.array(p) for p in params(model)]
            ckpts.save(step, model, extra={"model_path": str(base)})
    return root, base, trained


def test_export_writes_the_trained_params_exactly(run, tmp_path):
    root, base, trained = run
    out = export(run_dir=str(root / "run"), out=str(tmp_path / "hf"))  # newest step, float32
    model, _ = load_hf_model(out)
    for got, want in zip(params(model), trained[5], strict=True):
        assert jnp.array_equal(got, want)
    assert any(not jnp.array_equal(a, b) for a, b in zip(trained[3], trained[5]))  # the steps differ
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok.decode(tok("2+2=4")["input_ids"]) == "2+2=4"
    transformers.AutoModelForCausalLM.from_pretrained(out)  # loads where any HF checkpoint does


def test_export_an_earlier_step_in_bfloat16(run, tmp_path):
    root, _, trained = run
    out = export(run_dir=str(root / "run" / "checkpoints"), out=str(tmp_path / "hf"), step=3, dtype="bfloat16")
    model, config = load_hf_model(out)
    assert config.torch_dtype == "bfloat16"
    for got, want in zip(params(model), trained[3], strict=True):
        assert jnp.array_equal(got, want.astype(jnp.bfloat16).astype(got.dtype))


def test_bad_input_is_one_line_and_leaves_nothing(run, tmp_path, capsys):
    root, base, _ = run
    with pytest.raises(UserError, match="no orbax checkpoints; pass a training run directory"):
        export(run_dir=str(base), out=str(tmp_path / "a"))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep")
    with pytest.raises(UserError, match="not empty; choose a new OUT or pass --overwrite"):
        export(run_dir=str(root / "run"), out=str(tmp_path / "full"))
    assert (tmp_path / "full" / "x").read_text() == "keep"
    with pytest.raises(UserError, match="--model_path"):
        export(run_dir=str(root / "run"), out=str(tmp_path / "b"), model_path=str(tmp_path / "nowhere"))
    # a base without tokenizer files fails after the weights are written: OUT never appears
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(base / name, bare / name)
    with pytest.raises(FileNotFoundError, match="no tokenizer files"):
        export(run_dir=str(root / "run"), out=str(tmp_path / "c"), model_path=str(bare))
    assert sorted(os.listdir(tmp_path)) == ["bare", "full"]
    with pytest.raises(SystemExit) as exit_info:
        main([str(root / "run"), str(tmp_path / "d"), "--step", "4"])
    message = str(exit_info.value)
    assert message.startswith("error: ") and "\n" not in message and "4" in message
