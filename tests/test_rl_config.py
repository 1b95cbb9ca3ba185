"""Configs split by concern (rl/config.py): DapoConfig is the flat union of five small parts, so every gin
name users set (`rl.DapoConfig.*` in gin/ and docs/) still binds, with the defaults it had."""

import dataclasses
import pathlib
import re

import pytest

from portable_rl.errors import ConfigError
from portable_rl.rl.config import PARTS, DataConfig, GenerationConfig, LossConfig, SafetyConfig, ShapeConfig
from portable_rl.rl.dapo import DapoConfig

ROOT = pathlib.Path(__file__).resolve().parent.parent
# DapoConfig's defaults before the split (portable_rl/rl/dapo.py at 2fa2bde): the split must not move them.
DEFAULTS_BEFORE_SPLIT = dict(
    prompt_batch_size=32, n_samples=16, dynamic_sampling=True, max_gen_batches=3, temperature=1.0,
    max_response_tokens=64, overlong_buffer=0, overlong_penalty=1.0, advantage="grpo", mini_batch_size=32,
    ppo_epochs=1, clip_eps_low=0.2, clip_eps_high=0.28, dual_clip_c=None, loss_aggregation="token-mean",
    loss_norm_constant=None, policy_loss_mode="decoupled", min_seq_bucket=16, max_nonfinite_fraction=0.01)
# added since the split, with defaults that keep the old behaviour (full-vocabulary sampling)
DEFAULTS_BEFORE_SPLIT.update(top_p=1.0, top_k=-1)
# the first mini-batch's old logprobs from its own update's forward: the same values, one forward fewer
# (tests/test_learner_step.py checks the equality)
DEFAULTS_BEFORE_SPLIT.update(old_logprobs_from_update=True)


def test_dapo_config_is_the_disjoint_union_of_the_parts_with_the_old_defaults():
    owners = {}
    for name, part in PARTS.items():
        for f in dataclasses.fields(part):
            assert f.name not in owners, f"{f.name} in both {owners.get(f.name)} and {name}"
            owners[f.name] = name
    assert set(owners) == {f.name for f in dataclasses.fields(DapoConfig)} == set(DEFAULTS_BEFORE_SPLIT)
    assert dataclasses.asdict(DapoConfig()) == DEFAULTS_BEFORE_SPLIT


def test_every_dapo_config_name_in_gin_and_docs_still_exists():
    texts = [p.read_text() for p in [*ROOT.glob("gin/**/*.gin"), *ROOT.glob("docs/*.md"), ROOT / "README.md"]]
    names = {m for t in texts for m in re.findall(r"rl\.DapoConfig\.(\w+)", t)}
    assert len(names) >= 12  # the recipes set most of them
    fields = {f.name for f in dataclasses.fields(DapoConfig)}
    assert names <= fields, names - fields


def test_gin_binds_the_flat_names_into_the_parts():
    import gin

    from portable_rl import gin_utils

    gin_utils.register_library()
    with gin.unlock_config():
        gin.clear_config()
        gin.parse_config(["rl.DapoConfig.n_samples = 4", "rl.DapoConfig.mini_batch_size = 8",
                          "rl.DapoConfig.clip_eps_high = 0.3", "rl.DapoConfig.max_nonfinite_fraction = 0.5"])
        try:
            cfg = gin.get_configurable("rl.DapoConfig")()
        finally:
            gin.clear_config()
    assert cfg.generation == GenerationConfig(n_samples=4)
    assert cfg.loss == LossConfig(mini_batch_size=8, clip_eps_high=0.3)
    assert cfg.safety == SafetyConfig(max_nonfinite_fraction=0.5)
    assert cfg.data == DataConfig() and cfg.shapes == ShapeConfig()
    assert cfg.n_samples == 4 and cfg.rows_per_minibatch == 32  # the flat names read as before


def test_parts_round_trip_and_validate_their_own_fields():
    cfg = DapoConfig.from_parts(generation=GenerationConfig(n_samples=4, temperature=0.7),
                                loss=LossConfig(mini_batch_size=8, policy_loss_mode="bypass"))
    assert cfg == DapoConfig(n_samples=4, temperature=0.7, mini_batch_size=8, policy_loss_mode="bypass")
    assert hash(cfg) == hash(DapoConfig.from_parts(**{n: getattr(cfg, n) for n in PARTS}))
    assert dataclasses.replace(cfg, n_samples=8).generation.n_samples == 8
    with pytest.raises(TypeError, match="loss= takes a LossConfig"):
        DapoConfig.from_parts(loss=DataConfig())
    for part, bad, message in [(GenerationConfig, dict(n_samples=1), "at least 2 samples"),
                               (DataConfig, dict(max_gen_batches=0), "max_gen_batches=0"),
                               (LossConfig, dict(advantage="ppo"), "advantage='ppo'"),
                               (LossConfig, dict(policy_loss_mode="bypas"), "policy_loss_mode='bypas'"),
                               # checked when the config is built, not at the first loss evaluation
                               (LossConfig, dict(loss_aggregation="token_mean"), "loss_aggregation='token_mean'"),
                               (LossConfig, dict(ppo_epochs=0), "ppo_epochs=0"),
                               (LossConfig, dict(dual_clip_c=1.0), "dual_clip_c=1.0 must be > 1"),
                               (LossConfig, dict(overlong_buffer=-1), "overlong_buffer=-1"),
                               (LossConfig, dict(loss_norm_constant=0), "loss_norm_constant=0"),
                               (SafetyConfig, dict(max_nonfinite_fraction=2.0), "must be in \\[0, 1\\]")]:
        with pytest.raises(ConfigError, match=message):
            part(**bad)
        with pytest.raises(ConfigError, match=message):  # the same one-line error through the flat names
            DapoConfig(**bad)
    with pytest.raises(ConfigError, match="multiple of mini_batch_size"):  # a rule across two parts
        DapoConfig(prompt_batch_size=12, mini_batch_size=8)
