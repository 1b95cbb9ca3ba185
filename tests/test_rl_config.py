"""The loop's config objects (rl/config.py, rl/dapo.py, rl/diagnostics.py): DapoConfig is a plain dataclass of
five parts with one way to read each field; gin binds each part's fields, and an old flat binding fails with
one line naming its new home."""

import dataclasses
import pathlib
import re

import gin
import pytest

from portable_rl import gin_utils
from portable_rl.errors import ConfigError
from portable_rl.rl.config import DataConfig, GenerationConfig, LossConfig, PrecisionConfig, RunConfig, SafetyConfig, ShapeConfig
from portable_rl.rl.dapo import DapoConfig
from portable_rl.rl.config import DiagnosticsConfig
from portable_rl.rl.dapo import dapo_config

ROOT = pathlib.Path(__file__).resolve().parent.parent
# DapoConfig's defaults when it was one flat dataclass: the parts must keep them.
FLAT_DEFAULTS = dict(
    prompt_batch_size=32, n_samples=16, dynamic_sampling=True, max_gen_batches=3, temperature=1.0,
    max_response_tokens=64, overlong_buffer=0, overlong_penalty=1.0, advantage="grpo", mini_batch_size=32,
    ppo_epochs=1, clip_eps_low=0.2, clip_eps_high=0.28, dual_clip_c=None, loss_aggregation="token-mean",
    loss_norm_constant=None, policy_loss_mode="decoupled", min_seq_bucket=16, max_nonfinite_fraction=0.01,
    top_p=1.0, top_k=-1, old_logprobs_from_update=True, router_aux_loss_coef=0.0)


def test_dapo_config_is_its_parts_with_disjoint_fields_and_the_flat_defaults():
    cfg = DapoConfig()
    flat = {}
    for part in dataclasses.fields(DapoConfig):
        for name, value in dataclasses.asdict(getattr(cfg, part.name)).items():
            assert name not in flat, f"{name} in two parts"
            flat[name] = value
    assert flat == FLAT_DEFAULTS
    assert not any(hasattr(cfg, name) for name in FLAT_DEFAULTS)  # one way to read a field: through its part


def _parse(*bindings):
    gin_utils.register_library()
    with gin.unlock_config():
        gin.clear_config()
        gin.parse_config(list(bindings))


def test_gin_binds_each_part_without_a_reference_to_it():
    try:
        _parse("rl.GenerationConfig.n_samples = 4", "rl.LossConfig.mini_batch_size = 8",
               "rl.LossConfig.clip_eps_high = 0.3", "rl.SafetyConfig.max_nonfinite_fraction = 0.5")
        cfg = gin.get_configurable("rl.DapoConfig")()
    finally:
        gin.clear_config()
    assert cfg.generation == GenerationConfig(n_samples=4)
    assert cfg.loss == LossConfig(mini_batch_size=8, clip_eps_high=0.3)
    assert cfg.safety == SafetyConfig(max_nonfinite_fraction=0.5)
    assert cfg.data == DataConfig() and cfg.shapes == ShapeConfig()
    assert cfg.rows_per_minibatch == 32


@pytest.mark.parametrize("old, new", [("rl.DapoConfig.n_samples = 4", "rl.GenerationConfig.n_samples"),
                                      ("rl.DapoConfig.clip_eps_high = 0.3", "rl.LossConfig.clip_eps_high"),
                                      ("train.attention_impl = 'dense'", "learner_jax.MemoryConfig.attention_impl"),
                                      ("train.seed = 3", "rl.RunConfig.seed"),
                                      ("train.compute_dtype = 'float32'", "rl.PrecisionConfig.compute_dtype"),
                                      ("train.mismatch_split = False", "rl.DiagnosticsConfig.disabled"),
                                      ("train.algorithm = @rl.DapoConfig()", "train.dapo"),
                                      ("train.run = @rl.RunConfig()", "train.run_config")])
def test_an_old_flat_binding_fails_in_one_line_naming_its_new_home(old, new):
    message = _gin_exit_message(old)
    assert f"it moved: set {new}" in message and "\n" not in message


def _gin_exit_message(binding: str) -> str:
    """What `train` exits with when its gin config holds `binding`."""
    from portable_rl.train import register_gin

    register_gin()
    try:
        with pytest.raises(SystemExit) as e:
            try:
                _parse(binding)
            except ValueError as err:
                gin_utils.exit_gin_error(err)
    finally:
        gin.clear_config()
    return str(e.value)


@pytest.mark.parametrize("binding,new", [("learner.MemoryConfig.remat = 'none'", "learner_jax.MemoryConfig"),
                                         ("optim.make_optimizer.learning_rate = 0.1", "learner_jax.make_optimizer"),
                                         ("sharding.MeshConfig.fsdp = 2", "learner_jax.MeshConfig")])
def test_a_renamed_configurable_fails_in_one_line_naming_its_new_name(binding, new):
    message = _gin_exit_message(binding)
    assert f"it was renamed: use {new}" in message and "\n" not in message


def test_the_gin_files_use_no_flat_name():
    texts = {p: p.read_text() for p in ROOT.glob("gin/**/*.gin")}
    moved = {**gin_utils.MOVED, **gin_utils.moved_dapo_fields()}
    for path, text in texts.items():
        for line in text.splitlines():
            name = re.match(r"\s*([\w.]+)\s*=", line)
            assert not (name and name.group(1) in moved), f"{path}: {line}"
            assert not any(re.search(rf"(?<![\w.]){re.escape(old)}\b", line) for old in gin_utils.RENAMED), \
                f"{path}: {line}"


def test_parts_validate_their_own_fields_in_one_line():
    for part, bad, message in [(GenerationConfig, dict(n_samples=1), "at least 2 samples"),
                               (DataConfig, dict(max_gen_batches=0), "max_gen_batches=0"),
                               (LossConfig, dict(advantage="ppo"), "advantage='ppo'"),
                               (LossConfig, dict(policy_loss_mode="bypas"), "policy_loss_mode='bypas'"),
                               # checked when the config is built, not at the first loss evaluation
                               (LossConfig, dict(loss_aggregation="token_mean"), "loss_aggregation='token_mean'"),
                               (LossConfig, dict(ppo_epochs=0), "ppo_epochs=0"),
                               (LossConfig, dict(dual_clip_c=1.0), "dual_clip_c=1.0 must be > 1"),
                               (LossConfig, dict(clip_eps_low=-0.1), "clip_eps_low=-0.1"),
                               (LossConfig, dict(overlong_buffer=-1), "overlong_buffer=-1"),
                               (LossConfig, dict(loss_norm_constant=0), "loss_norm_constant=0"),
                               (SafetyConfig, dict(max_nonfinite_fraction=2.0), "must be in \\[0, 1\\]"),
                               (PrecisionConfig, dict(compute_dtype="fp16"), "compute_dtype='fp16'"),
                               (PrecisionConfig, dict(smoothquant_alpha=1.5), "smoothquant_alpha=1.5"),
                               (DiagnosticsConfig, dict(disabled=["probes"]), "disabled names \\['probes'\\]"),
                               (DiagnosticsConfig, dict(probe_prompts=0), "disabled = \\['probe'\\]")]:
        with pytest.raises(ConfigError, match=message):
            part(**bad)
    with pytest.raises(ConfigError, match="train_steps=0"):
        RunConfig(run_dir="r", train_steps=0, model_path="m")
    with pytest.raises(ConfigError, match="multiple of mini_batch_size"):  # a rule across two parts
        dapo_config(prompt_batch_size=12, mini_batch_size=8)
    with pytest.raises(TypeError, match="no part of DapoConfig has the fields \\['n_sample'\\]"):
        dapo_config(n_sample=4)


def test_diagnostics_turn_off_by_name_and_the_split_needs_the_probe():
    assert all(DiagnosticsConfig().enabled(n) for n in ("update_survival", "probe", "mismatch_split"))
    off = DiagnosticsConfig(disabled=["mismatch_split"])
    assert off.enabled("probe") and not off.enabled("mismatch_split") and off.disabled == ("mismatch_split",)
    assert not DiagnosticsConfig(disabled=("probe",)).enabled("mismatch_split")
