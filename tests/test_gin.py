"""Gin entry points: flags, search paths, REQUIRED macros, clear errors, and every shipped recipe resolves.

Recipes are parsed exactly as the CLI parses them, then each configurable `train` argument is built
(DapoConfig, RolloutCorrectionConfig, task, optimizer); engines are only checked to be registered with
the bound arguments (constructing SGLang or a 7B vLLM cannot run on this box).
"""

import inspect
import json
import subprocess
import sys
from pathlib import Path

import gin
import pytest

from portable_rl import gin_utils
from portable_rl.train import register_gin, train

REPO = Path(__file__).resolve().parent.parent
GIN = REPO / "gin"
TRAIN_FILES = ["dapo_fp8.gin", "recipes/qwen3_8b_base_dapo_math_sglang_fp8.gin",
               "recipes/qwen2_5_7b_dapo_math_vllm_fp8.gin", "recipes/llama3_8b_dapo_math_vllm_fp8.gin"]


@pytest.fixture
def fresh_gin():
    gin.clear_config()
    register_gin()
    yield
    gin.clear_config()


@pytest.fixture(scope="module")
def data_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    rows = [{"prompt": [{"role": "user", "content": f"What is {i}+{i}?"}],
             "reward_model": {"ground_truth": str(2 * i)}} for i in range(40)]
    (d / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (d / "aime.jsonl").write_text("\n".join(json.dumps(r) for r in rows[:5]))
    model = d / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    return d


def _resolve(value):
    if isinstance(value, gin.config.ConfigurableReference):
        return value.scoped_configurable_fn() if value.evaluate else value.scoped_configurable_fn
    return value


def _train_arguments() -> dict:
    """train()'s arguments as the parsed config gives them: the bound ones, and each config object built from
    its class's bindings (gin_utils.register_train)."""
    params = set(inspect.signature(train).parameters)
    bound = {k: _resolve(gin.query_parameter(f"train.{k}")) for k in params if _is_bound(f"train.{k}")}
    return {**{k: make() for k, make in gin_utils.CONFIG_OBJECTS.items() if k not in bound}, **bound}


def test_rewrite_gin_args_quotes_bare_words_only():
    out = gin_utils.rewrite_gin_args(["--gin.RUN_DIR=/tmp/x", "--gin.TRAIN_STEPS=3", "--gin.A='q'",
                                      "--gin.B=%C", "--gin.D", "None", "--gin_file=f.gin"])
    assert out == ["--gin_bindings=RUN_DIR = '/tmp/x'", "--gin_bindings=TRAIN_STEPS = 3",
                   "--gin_bindings=A = 'q'", "--gin_bindings=B = %C", "--gin_bindings=D = None", "--gin_file=f.gin"]


@pytest.mark.parametrize("name", TRAIN_FILES + ["grpo_bf16.gin", "dapo_fp8.gin+engines/sglang.gin",
                                                "dapo_fp8.gin+recipes/sequence_tis.gin",
                                                "dapo_fp8.gin+learner/mesh.gin",
                                                "recipes/smollm2_arith_int8.gin"])
def test_train_recipes_parse_and_resolve(name, fresh_gin, data_files, tmp_path):
    files = [f"gin/{f}" for f in name.split("+")]
    bindings = [f"RUN_DIR = '{tmp_path}/run'", "TRAIN_STEPS = 7", f"MODEL_PATH = '{data_files}/model'",
                f"DATA_PATH = '{data_files}/train.jsonl'", f"EVAL_DATA_PATH = '{data_files}/aime.jsonl'"]
    gin_utils.parse_gin(files, bindings)
    assert gin_utils.query_value("rl.RunConfig.run_dir") == f"{tmp_path}/run"
    assert gin_utils.query_value("rl.RunConfig.train_steps") == 7
    bound = _train_arguments()
    cfg, corr, task = bound["dapo"], bound["correction"], bound["task"]
    assert type(cfg).__name__ == "DapoConfig" and type(corr).__name__ == "RolloutCorrectionConfig"
    assert task.train_batch(0, 0, 2) and task.eval_examples()
    bound["optimizer_factory"]()  # builds the optax transformation
    assert callable(bound["engine_factory"])
    from portable_rl.engines import registry
    if "dapo_math" in name:  # the seeds' settings
        assert (cfg.data.prompt_batch_size, cfg.generation.n_samples, cfg.loss.clip_eps_high) == (32, 16, 0.28)
        assert (corr.mode, corr.clip) == ("token", 2.0)
    if "sequence_tis" in name:
        assert (corr.mode, corr.clip) == ("sequence", 4.0)
    if "mesh" in name:
        mesh = bound["mesh"]
        assert type(mesh).__name__ == "MeshConfig" and (mesh.data, mesh.fsdp, mesh.tensor) == (1, -1, 1)
    if "grpo" in name:
        assert not cfg.data.dynamic_sampling and cfg.loss.loss_aggregation == "seq-mean-token-mean"
    engine_name = "sglang" if "sglang" in name else "vllm"
    assert engine_name in registry.available_engines()
    scope = f"{engine_name}/engines.create_engine"
    assert gin.query_parameter(f"{scope}.name") == engine_name
    kwargs = gin_utils.query_value(f"{scope}.engine_init_kwargs")
    if engine_name == "vllm":
        expected = ("fp8" if "dapo_math" in name else None if "grpo" in name else
                    "int8_per_channel" if "int8" in name else "fp8_per_channel")
        assert kwargs["quantization"] == expected
        if "int8" in name:  # the INT8 start checkpoint is written next to the run
            assert gin_utils.query_value(f"{scope}.quantized_checkpoint_root") == f"{tmp_path}/run"
    else:
        assert gin_utils.query_value(f"{scope}.fp8_mode") == "blockwise"


def _is_bound(name):
    try:
        gin.query_parameter(name)
        return True
    except ValueError:
        return False


def test_every_train_file_exposes_run_dir_and_train_steps():
    for f in TRAIN_FILES + ["grpo_bf16.gin"]:
        chain = _with_includes(f)
        assert "RUN_DIR =" in chain and "TRAIN_STEPS =" in chain, f


def _with_includes(name):
    text = (GIN / name).read_text()
    incs = [line.split("'")[1] for line in text.splitlines() if line.startswith("include ")]
    return text + "".join(_with_includes(i) for i in incs)


def _cli(*args, cwd=REPO):
    return subprocess.run([sys.executable, "-m", *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_cli_errors_are_one_clear_line(tmp_path):
    bad = _cli("portable_rl.train", "--gin_file=gin/dapo_fp8.gin", "--gin.train.no_such_param=1")
    assert bad.returncode != 0
    last = bad.stderr.strip().splitlines()[-1]
    assert last.startswith("gin config error") and "no_such_param" in last and "train" in last
    missing = _cli("portable_rl.evaluate", "--gin_file=eval/arithmetic.gin", cwd=tmp_path)  # found via gin/
    assert missing.returncode != 0
    assert "required macro CHECKPOINT is not set; pass --gin.CHECKPOINT=VALUE" in missing.stderr.strip().splitlines()[-1]
    no_file = _cli("portable_rl.train", "--gin_file=nope.gin")
    assert no_file.returncode != 0 and "nope.gin" in no_file.stderr.strip().splitlines()[-1]


def test_evaluate_warns_of_a_macro_nothing_reads(tmp_path):
    """docs/evaluation.md's trap: gin/eval/dapo_math.gin binds evaluate.temperature itself, so a --gin.TEMPERATURE
    changes nothing; evaluate says so (the planner's check, gin_utils.gin_traps) before it starts."""
    data = tmp_path / "aime.jsonl"
    data.write_text(json.dumps({"prompt": [{"role": "user", "content": "1+1?"}],
                                "reward_model": {"ground_truth": "2"}}) + "\n")
    out = _cli("portable_rl.evaluate", "--gin_file=gin/eval/dapo_math.gin", f"--gin.EVAL_DATA_PATH={data}",
               f"--gin.CHECKPOINT={tmp_path / 'no_checkpoint'}", "--gin.TEMPERATURE=0.6")
    lines = out.stderr.strip().splitlines()
    assert out.returncode != 0 and "checkpoint" in lines[-1] and "does not exist" in lines[-1], out.stderr
    assert "warning: macro TEMPERATURE is bound but nothing reads it" in lines, out.stderr
    assert not any(line.startswith("warning: macro") and "TEMPERATURE" not in line for line in lines), out.stderr


def test_gin_search_paths_find_user_files(tmp_path, fresh_gin):
    (tmp_path / "mine.gin").write_text("include 'dapo_fp8.gin'\nTRAIN_STEPS = 11\n")
    gin_utils.parse_gin(["mine.gin"], ["RUN_DIR = 'r'"], [str(tmp_path)])
    assert gin_utils.query_value("rl.RunConfig.train_steps") == 11
    path = gin_utils.write_config(tmp_path / "run")
    assert "TRAIN_STEPS = 11" in path.read_text()


def test_every_gin_file_the_repo_names_exists():
    """Comments, docs and code that point a reader at gin/....gin point at a file that is there (issue 15)."""
    import re

    sources = [*GIN.rglob("*.gin"), *(REPO / "docs").glob("*.md"), REPO / "README.md",
               *(REPO / "portable_rl").rglob("*.py"), *(REPO / "benchmarks").glob("*.py"),
               *(REPO / "experiments").glob("*.py")]
    named = {(m, src.relative_to(REPO)) for src in sources
             for m in re.findall(r"gin/[\w./-]+?\.gin", src.read_text())}
    assert len(named) > 10
    missing = sorted((str(src), name) for name, src in named if not (REPO / name).is_file())
    assert not missing, missing


def test_smollm2_eval_file_scores_the_recipes_held_out_problems(tmp_path):
    """gin/eval/smollm2_word_problems.gin must evaluate what the recipe logs as accuracy/heldout: the same
    problems (task settings and seed), chat template, engine quantization and answer length."""
    from portable_rl import evaluate as evaluate_module

    def bound(files, bindings, name):
        gin.clear_config()
        register_gin()
        gin_utils.register_configurable(evaluate_module.evaluate, name="evaluate")
        gin_utils.parse_gin(files, bindings)
        chat_template = "rl.RunConfig.chat_template" if name == "train" else "evaluate.chat_template"
        values = {"task": _resolve(gin.query_parameter(f"{name}.task")),
                  "chat_template": gin_utils.query_value(chat_template)}
        return values, gin_utils.query_value("vllm/engines.create_engine.engine_init_kwargs")

    try:
        recipe, recipe_engine = bound(["gin/recipes/smollm2_arith_fp8.gin"], [f"RUN_DIR = '{tmp_path}'"], "train")
        recipe_tokens = gin_utils.query_value("rl.RunConfig.eval_max_tokens")
        ev, eval_engine = bound(["gin/eval/smollm2_word_problems.gin"], [f"CHECKPOINT = '{tmp_path}'"], "evaluate")
        eval_tokens = gin_utils.query_value("evaluate.max_tokens")
    finally:
        gin.clear_config()
    assert ev["task"].eval_examples() == recipe["task"].eval_examples() and len(ev["task"].eval_examples()) == 128
    assert ev["chat_template"] is recipe["chat_template"] is True
    assert eval_engine == recipe_engine and eval_tokens == recipe_tokens == 160


def test_the_gin_files_docs_your_model_shows_parse_and_bind(fresh_gin, data_files, tmp_path):
    """Every recipe docs/your-model.md names parses and binds train() (no engine starts), as its command runs it."""
    import re

    text = (REPO / "docs" / "your-model.md").read_text()
    recipes = sorted(set(re.findall(r"gin/recipes/[\w.]+\.gin", text)))
    assert "gin/recipes/llama3_8b_dapo_math_vllm_fp8.gin" in recipes
    for recipe in recipes:
        gin.clear_config()  # as the page shows it (the colocated recipes include gin/colocate.gin themselves)
        register_gin()
        gin_utils.parse_gin([recipe], [f"RUN_DIR = '{tmp_path}/run'", f"MODEL_PATH = '{data_files}/model'",
                                       f"DATA_PATH = '{data_files}/train.jsonl'",
                                       f"EVAL_DATA_PATH = '{data_files}/aime.jsonl'"])
        assert callable(_resolve(gin.query_parameter("train.engine_factory")))
        assert gin_utils.query_value("rl.RunConfig.model_path") == f"{data_files}/model"

def test_sql_recipe_eval_file_and_warm_start_share_one_environment(tmp_path):
    """gin/recipes/smollm2_sql_fp8.gin: the SQL environment with one max_turns for the driver, the environment and
    the warm start's traces; gin/eval/sql_generated.gin evaluates the run's held-out questions in the same
    environment, chat template and engine."""
    from portable_rl import evaluate as evaluate_module
    from portable_rl.rl.turns import environment_factory

    cache = f"SQL_CACHE_DIR = '{tmp_path}/db'"

    def bound(files, bindings, name):
        gin.clear_config()
        register_gin()
        gin_utils.register_configurable(evaluate_module.evaluate, name="evaluate")
        gin_utils.parse_gin(files, bindings + [cache])
        chat_template = "rl.RunConfig.chat_template" if name == "train" else "evaluate.chat_template"
        return {"task": _resolve(gin.query_parameter(f"{name}.task")), "environment": gin_utils.CONFIG_OBJECTS[
                "environment"](), "chat_template": gin_utils.query_value(chat_template),
                "engine": gin_utils.query_value("vllm/engines.create_engine.engine_init_kwargs")}

    try:
        recipe = bound(["gin/recipes/smollm2_sql_fp8.gin"], [f"RUN_DIR = '{tmp_path}/run'"], "train")
        traces = _resolve(gin.query_parameter("warmstart.task"))
        recipe_tokens = gin_utils.query_value("rl.RunConfig.eval_max_tokens")
        ev = bound(["gin/eval/sql_generated.gin"], [f"CHECKPOINT = '{tmp_path}'"], "evaluate")
        eval_tokens = gin_utils.query_value("evaluate.max_tokens")
    finally:
        gin.clear_config()
    env = recipe["environment"]
    assert env.name == "sql" and env == ev["environment"] and recipe["task"].reward is None
    assert environment_factory(env, None)().max_turns == traces.max_turns == env.max_turns == 4
    assert dict(traces.environment_kwargs) == env.kwargs
    assert ev["task"].eval_examples() == recipe["task"].eval_examples()
    assert ev["chat_template"] is recipe["chat_template"] is True
    assert ev["engine"] == recipe["engine"] and eval_tokens == recipe_tokens
