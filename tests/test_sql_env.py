"""The SQL environment on real SQLite files: safe execution, the turn protocol, the reward, the data sides."""

import concurrent.futures
import hashlib
import os
import re
import sqlite3
import time

import numpy as np
import pytest

from portable_rl.engines.base import prompt_seeds
from portable_rl.environments import get_environment
from portable_rl.environments.sql import SqlEnvironment
from portable_rl.errors import ConfigError
from portable_rl.tasks.base import Example
from portable_rl.tasks.sql_data import (FAMILIES, GENERATOR_VERSION, SqlDataError, SqlTask, SqlTraceTask,
                                        SkyrlSqlTask, database_path, read_skyrl_sql, render, spelling, tool_trace)

TIMEOUT_S = 1.0


def _sha256(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def _make_db(path):
    conn = sqlite3.connect(path)
    conn.executescript("""CREATE TABLE t (id INTEGER PRIMARY KEY, name TEXT, city TEXT, score REAL);
                          CREATE TABLE u (id INTEGER PRIMARY KEY, t_id INTEGER, tag TEXT);
                          CREATE INDEX u_tag ON u (tag);""")
    conn.executemany("INSERT INTO t VALUES (?, ?, ?, ?)",
                     [(i, f"n{i}", ["Oslo", "Rome", "Lima"][i % 3], i / 3) for i in range(100)])
    conn.executemany("INSERT INTO u VALUES (?, ?, ?)", [(i, i % 10, "x" if i % 2 else "y") for i in range(40)])
    conn.commit()
    conn.close()
    return str(path)


@pytest.fixture
def db(tmp_path):
    return _make_db(tmp_path / "toy.sqlite")


def _env(db_path, gold="SELECT name FROM t WHERE city = 'Oslo'", **kwargs):
    env = SqlEnvironment(query_timeout_s=TIMEOUT_S, **kwargs)
    env.reset(Example(prompt="q", answer=gold, metadata={"db_id": "toy", "db_path": db_path}))
    return env


_BAD_SQL = {
    "drop_table": ("DROP TABLE t", "not authorized"),
    "attach": ("ATTACH DATABASE '{dir}/other.sqlite' AS other", "not authorized"),
    "writable_schema": ("PRAGMA writable_schema=1", "not authorized"),
    "endless_recursive_cte": ("WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT max(x) FROM c",
                              "time limit"),
    "cross_join_1e8": ("SELECT max(a.name || b.name || c.name || d.name) FROM t a, t b, t c, t d", "time limit"),
    "string_50mb": ("SELECT '" + "x" * 50_000_000 + "'", "characters long"),
    "invalid_utf8": (b"SELECT '\xff\xfe'".decode("utf-8", "surrogateescape"), "not valid UTF-8"),
    "second_statement": ("SELECT 1; DROP TABLE t", "one statement"),
    "missing_table": ("SELECT * FROM no_such_table", "no such table"),
}


@pytest.mark.parametrize("case", sorted(_BAD_SQL))
def test_bad_sql_is_an_error_observation_in_time_and_the_file_is_unchanged(db, tmp_path, case):
    query, expected = _BAD_SQL[case]
    query = query.replace("{dir}", str(tmp_path))
    before = _sha256(db)
    env = _env(db)
    start = time.monotonic()
    step = env.step(f"<sql>{query}</sql>")
    assert time.monotonic() - start < 3 * TIMEOUT_S
    assert not step.done and step.reward == 0.0 and step.info["query_error"]
    assert step.observation.startswith("<observation>\nError") and expected in step.observation
    assert len(step.observation) < 5000
    # The same query as the final answer scores 0 and raises nothing.
    assert _env(db).step(f"<solution>{query}</solution>").reward == 0.0
    assert _sha256(db) == before
    assert sorted(os.listdir(tmp_path)) == ["toy.sqlite"]  # no journal, no attached file
    # The environment keeps working: a good query and a right answer after the bad one.
    assert "n3" in env.step("<sql>SELECT name FROM t WHERE id = 3</sql>").observation
    assert env.step("<solution>SELECT name FROM t WHERE city = 'Oslo'</solution>").reward == 1.0


@pytest.mark.parametrize("query", ["INSERT INTO t VALUES (1000, 'a', 'b', 0)", "CREATE INDEX ix ON t (name)", "REINDEX",
                                   "ANALYZE", "VACUUM", "PRAGMA query_only=OFF", "PRAGMA journal_mode=WAL",
                                   "SELECT fts3_tokenizer('simple')", "SELECT load_extension('x')"])
def test_other_writes_and_unsafe_functions_are_refused(db, query):
    before = _sha256(db)
    step = _env(db).step(f"<sql>{query}</sql>")
    assert step.observation.startswith("<observation>\nError") and _sha256(db) == before


def test_schema_reads_are_allowed(db):
    env = _env(db)
    assert "t_id" in env.step("<sql>PRAGMA table_info(u)</sql>").observation
    assert "CREATE TABLE u" in env.step("<sql>SELECT sql FROM sqlite_master WHERE name = 'u'</sql>").observation


def test_invalid_utf8_stored_in_the_database_is_shown_not_raised(db):
    step = _env(db).step("<sql>SELECT CAST(X'FFFE' AS TEXT)</sql>")
    assert "\ufffd" in step.observation and not step.info["query_error"]


def test_observation_caps_rows_and_bytes_and_says_so(db):
    step = _env(db, max_rows=5).step("<sql>SELECT id FROM t</sql>")
    lines = step.observation.splitlines()
    assert lines[1:7] == ["id", "0", "1", "2", "3", "4"]
    assert "(truncated: showing the first 5 of more than 5 rows)" in step.observation
    step = _env(db, max_observation_bytes=300).step("<sql>SELECT name, city, score FROM t</sql>")
    table, note = step.observation.removeprefix("<observation>\n").split("\n(truncated: ")
    assert len(table.encode()) <= 300 and note.startswith("showing the first 10 of more than 50 rows)")
    step = _env(db).step("<sql>SELECT id FROM t WHERE id < 0</sql>")
    assert "(no rows)" in step.observation


def test_large_values_are_cut_in_observations_and_a_huge_result_never_matches(db):
    start = time.monotonic()
    step = _env(db).step("<sql>SELECT id, zeroblob(999999) FROM t</sql>")  # 100 MB of blobs
    assert len(step.observation) < 5000 and "truncated" in step.observation and "…" in step.observation
    huge = "SELECT id, zeroblob(999999) FROM t"
    assert _env(db, gold=huge).step(f"<solution>{huge}</solution>").reward == 0.0  # over the 16 MB fetch budget
    assert time.monotonic() - start < 3 * TIMEOUT_S


def test_turn_protocol_reminders_and_format_errors(db):
    env = _env(db, max_turns=3)
    first = env.step("<think>look</think><sql>SELECT COUNT(*) FROM t</sql>")
    assert first.observation == ("<observation>\nCOUNT(*)\n100\n"
                                 "<reminder>You have 2 turns left to complete the task.</reminder>\n</observation>")
    second = env.step("I am not sure.")
    assert "invalid" in second.observation and not second.done and second.info["action"] == "invalid"
    last = env.step("<sql>SELECT 1</sql>")  # the last turn without a solution is a format error
    assert last.done and last.reward == 0.0 and last.observation is None and last.info["format_error"]


def test_a_missing_closing_tag_at_the_end_of_a_turn_is_accepted(db):
    # A turn cut at max_tokens may end inside its tag (a stop string ends it with the closing tag kept).
    assert "n3" in _env(db).step("<sql>SELECT name FROM t WHERE id = 3").observation
    assert _env(db).step("<solution>SELECT name FROM t WHERE city = 'Oslo'").reward == 1.0


@pytest.mark.parametrize("gold, answer, reward", [
    ("SELECT name FROM t WHERE city = 'Oslo'", "SELECT name FROM t WHERE id % 3 = 0", 1.0),       # other SQL, same rows
    ("SELECT name FROM t WHERE city = 'Oslo'", "SELECT name FROM t WHERE city = 'Oslo' ORDER BY id DESC", 1.0),
    ("SELECT name FROM t WHERE city = 'Oslo' ORDER BY id",
     "SELECT name FROM t WHERE city = 'Oslo' ORDER BY id DESC", 0.0),
    ("SELECT name FROM t WHERE city = 'Oslo' ORDER BY id",
     "SELECT name FROM t WHERE city = 'Oslo' ORDER BY score", 1.0),
    ("SELECT tag FROM u", "SELECT DISTINCT tag FROM u", 0.0),                                      # multisets
    ("SELECT AVG(score) FROM t", "SELECT SUM(score) / COUNT(*) FROM t", 1.0),                      # float rounding
    ("SELECT name, city FROM t", "SELECT city, name FROM t", 0.0),                                 # column order counts
    ("SELECT name FROM t WHERE city = 'Oslo'", "SELECT name FROM t WHERE city = 'Rome'", 0.0),
    ("SELECT name FROM t WHERE city = 'Oslo'", "SELECT nonsense", 0.0),
])
def test_reward_is_result_set_equality(db, gold, answer, reward):
    step = _env(db, gold=gold).step(f"<solution>{answer}</solution>")
    assert step.done and step.reward == reward and step.observation is None


@pytest.mark.parametrize("empty", ["", "   ", "-- nothing", ";"])
def test_an_empty_statement_is_an_error_not_an_empty_result(db, empty):
    env = _env(db, gold="SELECT name FROM t WHERE id < 0")  # the gold result is empty
    assert "Error: the statement is empty" in env.step(f"<sql>{empty}</sql>").observation
    assert env.step(f"<solution>{empty}</solution>").reward == 0.0


def test_a_result_larger_than_max_result_rows_never_matches(db):
    env = _env(db, gold="SELECT id FROM t", max_result_rows=50)
    assert env.step("<solution>SELECT id FROM t</solution>").reward == 0


def test_steps_may_run_on_pool_threads_other_than_the_reset_thread(db):
    env = _env(db)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        obs = pool.submit(env.step, "<sql>SELECT COUNT(*) FROM u</sql>").result().observation
        final = pool.submit(env.step, "<solution>SELECT name FROM t WHERE city = 'Oslo'</solution>").result()
    assert "\n40\n" in obs and final.reward == 1.0
    env.close()


def test_a_query_at_its_time_limit_does_not_hold_up_other_trajectories(db):
    slow, fast = _env(db), _env(db, max_turns=100)
    endless = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT max(x) FROM c"
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        stuck = pool.submit(slow.step, f"<sql>{endless}</sql>")
        start = time.monotonic()
        for _ in range(50):
            assert "\n40\n" in fast.step("<sql>SELECT COUNT(*) FROM u</sql>").observation
        fast_s = time.monotonic() - start
        assert "time limit" in stuck.result().observation
    assert fast_s < 0.8 * TIMEOUT_S  # sqlite3 releases the GIL while a statement runs: no wait for the limit


def test_registry_and_bad_config(db, tmp_path):
    assert get_environment("sql") is SqlEnvironment
    with pytest.raises((KeyError, ValueError), match="sqll"):  # whatever the registry's error, it names the name
        get_environment("sqll")
    with pytest.raises(ConfigError, match="max_turns"):
        SqlEnvironment(max_turns=0)
    with pytest.raises(ConfigError, match="db_path"):
        SqlEnvironment().reset(Example(prompt="q", answer="SELECT 1"))
    with pytest.raises(ConfigError, match="does not exist"):
        SqlEnvironment().reset(Example(prompt="q", answer="SELECT 1",
                                       metadata={"db_path": str(tmp_path / "no.sqlite")}))
    assert not (tmp_path / "no.sqlite").exists()  # opening read-only never creates the file


# ---- the generator ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return SqlTask(cache_dir=str(tmp_path_factory.mktemp("sqlcache")), num_eval=60)


def test_generated_batches_are_deterministic_and_skip_the_held_out_set(task):
    again = SqlTask(cache_dir=task.cache_dir, num_eval=60)
    assert task.train_batch(3, 1, 16) == again.train_batch(3, 1, 16)
    assert task.train_batch(3, 1, 16) != task.train_batch(3, 2, 16)
    assert task.eval_examples() == again.eval_examples() and len(task.eval_examples()) == 60
    held_out = {e.prompt for e in task.eval_examples()}
    assert not any(e.prompt in held_out for step in range(20) for e in task.train_batch(step, 0, 32))


def test_database_files_are_written_once_and_depend_only_on_family_instance_version(task, tmp_path):
    path = database_path(task.cache_dir, "shop", 0)
    assert path.endswith(f"shop_0-v{GENERATOR_VERSION}.sqlite")
    mtime = os.stat(path).st_mtime_ns
    SqlTask(cache_dir=task.cache_dir, num_eval=10)
    assert os.stat(path).st_mtime_ns == mtime  # reused, not rewritten
    assert _sha256(database_path(str(tmp_path), "shop", 0)) == _sha256(path)
    assert _sha256(database_path(str(tmp_path), "shop", 1)) != _sha256(path)


def test_every_template_gold_query_runs_on_every_database_and_levels_are_graded(task):
    for family_name, family in FAMILIES.items():
        assert sorted({t.level for t in family.templates}) == [1, 2, 3, 4]
        for instance in range(task.num_databases):
            env = SqlEnvironment()
            for template in family.templates:
                for draw in range(5):
                    question, gold = render(family, template, np.random.default_rng(draw))
                    assert "{" not in question + gold
                    env.reset(Example(prompt=question, answer=gold,
                                      metadata={"db_path": database_path(task.cache_dir, family_name, instance)}))
                    assert env.step(f"<solution>{gold}</solution>").reward == 1.0, gold
            env.close()
    easy = SqlTask(cache_dir=task.cache_dir, levels=(1,), families=("flights",), num_eval=10)
    batch = easy.train_batch(0, 0, 20)
    assert {e.metadata["level"] for e in batch} == {1}
    assert all(e.metadata["db_id"].startswith("flights_") for e in batch)
    assert all("JOIN" not in e.answer for e in batch)


def test_generated_questions_have_non_empty_answers(task):
    from portable_rl.environments.sql import ReadOnlyDatabase

    for example in task.train_batch(0, 0, 64) + task.eval_examples():
        db = ReadOnlyDatabase(example.metadata["db_path"])
        rows = db.execute(example.answer, 10_000).rows
        db.close()
        assert any(v is not None for row in rows for v in row), example.answer


def test_generated_task_bad_config(task):
    with pytest.raises(ConfigError, match="families"):
        SqlTask(cache_dir=task.cache_dir, families=("zoo",))
    with pytest.raises(ConfigError, match="levels"):
        SqlTask(cache_dir=task.cache_dir, levels=(5,))
    with pytest.raises(ConfigError, match="num_eval"):
        SqlTask(cache_dir=task.cache_dir, families=("shop",), levels=(1,), num_databases=1, num_eval=10_000)


def test_tool_traces_carry_real_observations_and_solve_the_question(task):
    example = task.train_batch(0, 0, 1)[0]
    for peek in (0.0, 1.0):
        turns = tool_trace(example, np.random.default_rng(0), peek_probability=peek)
        assert [t["role"] for t in turns] == ["assistant", "user"] * (1 + int(peek)) + ["assistant"]
        assert turns[-1]["content"] == f"<solution>{example.answer}</solution>"
        env = SqlEnvironment()
        env.reset(example)
        for turn, observation in zip(turns[0::2], turns[1::2]):
            assert env.step(turn["content"]).observation == observation["content"]
        assert env.step(turns[-1]["content"]).reward == 1.0
    traces = SqlTraceTask(task)
    batch = traces.train_batch(0, 0, 4)
    assert batch == traces.train_batch(0, 0, 4)
    assert [e.prompt for e in batch] == [e.prompt for e in task.train_batch(0, 0, 4)]
    assert all("<observation>" in e.answer and e.answer.endswith("</solution>") for e in batch)


def test_tool_traces_fit_short_turn_limits(task):
    """max_turns 2 leaves one query (no peek), max_turns 1 answers at once: the no-tool ablation's warm start."""
    example = task.train_batch(0, 0, 1)[0]
    for max_turns, roles in ((2, ["assistant", "user", "assistant"]), (1, ["assistant"])):
        turns = tool_trace(example, np.random.default_rng(0), peek_probability=1.0, max_turns=max_turns)
        assert [t["role"] for t in turns] == roles
        env = SqlEnvironment(max_turns=max_turns)
        env.reset(example)
        for turn in turns[0::2][:-1]:
            assert not env.step(turn["content"]).done
        final = env.step(turns[-1]["content"])
        assert final.done and final.reward == 1.0
    no_tool = SqlTraceTask(task, max_turns=1).train_batch(0, 0, 4)
    assert all(e.answer.startswith("<solution>") and "<sql>" not in e.answer for e in no_tool)


def test_spelled_databases_hold_values_only_a_query_shows(task):
    """spelled_values: each database stores a question's named values its own way (PARIS, PAR or Paris#NN, per
    database and column), in files of their own; the gold query uses that spelling and scores 1, the question's
    own word finds nothing, and the lookup the traces make shows the stored spelling."""
    spelled = SqlTask(cache_dir=task.cache_dir, num_eval=10, spelled_values=True)
    assert database_path(task.cache_dir, "shop", 0, spelled=True).endswith(f"shop_0-v{GENERATOR_VERSION}-spelled.sqlite")
    assert _sha256(database_path(task.cache_dir, "shop", 0)) != _sha256(database_path(task.cache_dir, "shop", 0, True))
    kinds = {("upper" if spell("Paris") == "PARIS" else "code" if spell("Paris") == "PAR" else "tag")
             for family in FAMILIES for instance in range(4) for spell in spelling(family, instance).values()}
    assert kinds == {"upper", "code", "tag"}
    examples = [e for e in spelled.train_batch(0, 0, 64) if e.metadata["lookups"]]
    looked_up = 0
    for example in examples:
        family, instance = example.metadata["db_id"].split("_")
        env = SqlEnvironment(max_rows=20)
        env.reset(example)
        observation = env.step(f"<sql>{example.metadata['lookups'][0]}</sql>").observation
        stored = [value for value in re.findall(r"'([^']*)'", example.answer)]
        assert stored
        if not all(value in observation for value in stored):  # e.g. "how many customers live in X": none do
            continue
        looked_up += 1
        question = example.prompt.split("Question:")[1]
        for value in stored:  # the question names the value as the vocabulary spells it, not as it is stored
            word, = {w for w in re.findall(r"[A-Za-z]+", question)
                     for spell in spelling(family, int(instance)).values() if spell(w) == value}
            assert f"'{word}'" not in example.answer
            plain = example.answer.replace(f"'{value}'", f"'{word}'")
            assert env.step(f"<solution>{plain}</solution>").reward == 0.0  # the question's own word finds nothing
            env.reset(example)
        assert env.step(f"<solution>{example.answer}</solution>").reward == 1.0
        env.close()
    assert looked_up >= 16
    trace = tool_trace(examples[0], np.random.default_rng(0), max_turns=4, max_rows=20)
    assert trace[0]["content"] == f"<sql>{examples[0].metadata['lookups'][0]}</sql>"
    assert trace[-1]["content"] == f"<solution>{examples[0].answer}</solution>"
    assert [t["role"] for t in tool_trace(examples[0], np.random.default_rng(0), max_turns=1)] == ["assistant"]


# ---- SkyRL-SQL's published data ------------------------------------------------------------------------------------

def _skyrl_rows(db_ids, newfmt=True):
    system = "Task Overview:\nYou are a data science expert. ... <sql>...</sql> ... <solution>...</solution>."
    rows = []
    for db_id in db_ids:
        row = {"data_source": "synsql",
               "prompt": [{"role": "system", "content": system},
                          {"role": "user",
                           "content": "{db_details}:CREATE TABLE t (...); {question}: names in Oslo?"}],
               "db_id": db_id, "data": "synsql"}
        gold = {"ground_truth": "SELECT name FROM t WHERE city = 'Oslo'"}
        if newfmt:
            row.update(env_class="text2sql", reward_spec={"method": "rule", **gold})
        else:
            row.update(ability="synsql", reward_model={"style": "rule", **gold},
                       extra_info={"split": "train", "index": 0})
        rows.append(row)
    return rows


def _write_parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


@pytest.mark.parametrize("newfmt", [True, False])
def test_skyrl_sql_parquet_and_database_directory(tmp_path, newfmt):
    root = tmp_path / "data"
    (root / "SynSQL-2.5M" / "databases" / "toy_db").mkdir(parents=True)
    db_path = _make_db(root / "SynSQL-2.5M" / "databases" / "toy_db" / "toy_db.sqlite")
    parquet = _write_parquet(tmp_path / "train.parquet", _skyrl_rows(["toy_db", "absent_db"], newfmt))
    examples, skipped = read_skyrl_sql(parquet, str(root))
    assert skipped == {"missing_database": 1} and len(examples) == 1
    example = examples[0]
    assert example.answer == "SELECT name FROM t WHERE city = 'Oslo'"
    assert example.metadata["db_id"] == "toy_db" and example.metadata["db_path"] == db_path
    assert example.prompt.endswith("names in Oslo?")
    env = SqlEnvironment()
    first = env.reset(example)
    assert [m["role"] for m in first] == ["system", "user"]  # the published chat messages, as they are
    assert env.step("<sql>SELECT COUNT(*) FROM t</sql>").observation.startswith("<observation>\nCOUNT(*)\n100")
    assert env.step("<solution>SELECT name FROM t WHERE id % 3 = 0</solution>").reward == 1.0
    task = SkyrlSqlTask(train_path=parquet, eval_path=parquet, db_root=str(root), num_eval=1)
    assert task.train_batch(0, 0, 3) == [example] * 3 and task.eval_examples() == [example]
    assert task.skipped_rows == 2


def test_skyrl_sql_bad_input_names_the_fix(tmp_path):
    parquet = _write_parquet(tmp_path / "train.parquet", _skyrl_rows(["absent_db"]))
    with pytest.raises(FileNotFoundError, match="db_root|database directory"):
        read_skyrl_sql(parquet, str(tmp_path / "nowhere"))
    with pytest.raises(SqlDataError, match="missing_database"):
        read_skyrl_sql(parquet, str(tmp_path))
    with pytest.raises(FileNotFoundError, match="SkyRL-SQL-653"):
        read_skyrl_sql(str(tmp_path / "none.parquet"), str(tmp_path))


# ---- gin ------------------------------------------------------------------------------------------------------------

@pytest.fixture
def clean_gin():
    import gin
    gin.clear_config()
    yield gin
    gin.clear_config()


def test_gin_data_files_build_the_sql_tasks(clean_gin, task, tmp_path):
    from portable_rl import gin_utils

    gin_utils.parse_gin(["gin/data/sql_generated.gin"], ["SEED = 3", f"SQL_CACHE_DIR = '{task.cache_dir}'",
                                                          "SQL_LEVELS = (1, 2)"])
    built = clean_gin.query_parameter("%TASK").scoped_configurable_fn()
    assert isinstance(built, SqlTask) and built.seed == 3 and built.levels == (1, 2)
    clean_gin.clear_config()
    root = tmp_path / "data"
    (root / "spider" / "database" / "toy_db").mkdir(parents=True)
    _make_db(root / "spider" / "database" / "toy_db" / "toy_db.sqlite")
    rows = [{**row, "data": "spider", "data_source": "spider"} for row in _skyrl_rows(["toy_db"])]
    parquet = _write_parquet(tmp_path / "train.parquet", rows)
    gin_utils.parse_gin(["gin/data/skyrl_sql.gin"], ["SEED = 0", f"SQL_TRAIN_PATH = '{parquet}'",
                                                     f"SQL_EVAL_PATH = '{parquet}'", f"SQL_DB_ROOT = '{root}'"])
    built = clean_gin.query_parameter("%TASK").scoped_configurable_fn()
    assert isinstance(built, SkyrlSqlTask) and built.eval_examples()[0].metadata["db_id"] == "toy_db"


def test_the_7b_sql_recipe_parses_with_the_seed_settings(clean_gin):
    from portable_rl.train import register_gin

    register_gin()
    from portable_rl import gin_utils

    gin_utils.parse_gin(["gin/recipes/qwen2_5_coder_7b_sql_vllm_fp8.gin"],
                        ["MODEL_PATH = '/m'", "SQL_TRAIN_PATH = '/t'", "SQL_EVAL_PATH = '/v'", "SQL_DB_ROOT = '/d'"])
    q = clean_gin.query_parameter
    assert (q("tis.RolloutCorrectionConfig.mode"), q("tis.RolloutCorrectionConfig.clip")) == ("sequence", 4.0)
    assert (q("rl.DataConfig.prompt_batch_size"), q("rl.GenerationConfig.n_samples")) == (256, 5)
    assert q("%QUANTIZATION") == "fp8" and q("%LEARNING_RATE") == 1e-6 and q("%MAX_RESPONSE_TOKENS") == 3000


# ---- wiring: rl.EnvironmentConfig ↔ the SQL tasks ------------------------------------------------------------------

def test_sql_tasks_are_scored_by_the_environment_and_mismatches_name_the_fix(task):
    from portable_rl.rl.config import EnvironmentConfig
    from portable_rl.rl.turns import environment_factory, task_reward
    from portable_rl.tasks import ArithmeticTask

    sql = EnvironmentConfig(name="sql", max_turns=4)
    example = task.eval_examples()[0]
    assert task.reward is None and task_reward(sql, task, example) is None
    env = environment_factory(sql, None)()
    assert env.max_turns == 4  # rl.EnvironmentConfig.max_turns is the environment's too
    with pytest.raises(ConfigError, match="has no text reward.*gin/data/sql_generated.gin"):
        task_reward(EnvironmentConfig(), task, example)
    arithmetic = ArithmeticTask(num_eval=4)
    with pytest.raises(ConfigError, match="db_path"):
        task_reward(sql, arithmetic, arithmetic.eval_examples()[0])
    assert task_reward(EnvironmentConfig(), arithmetic, arithmetic.eval_examples()[0])("85", "85") == 1.0
    with pytest.raises(ConfigError, match="set rl.EnvironmentConfig.max_turns instead"):
        environment_factory(EnvironmentConfig(name="sql", kwargs={"max_turns": 3}), None)


def test_sql_trajectories_through_the_driver_on_a_real_database(task, tmp_path):
    """The driver, the real SQL environment and SQLite: a scripted policy that explores, then answers (right on odd
    seeds, a wrong query on even ones) → execution rewards, turns and finish reasons, observations masked."""
    from portable_rl.engines.base import EngineAdapter, Rollout, SamplingConfig
    from portable_rl.rl.codec import TextCodec
    from portable_rl.rl.config import EnvironmentConfig
    from portable_rl.rl.evaluation import evaluate_examples
    from portable_rl.convert.tiny_checkpoint import char_tokenizer

    char_tokenizer().save_pretrained(tmp_path)
    codec = TextCodec(tmp_path)
    examples = task.eval_examples()[:3]
    # The char tokenizer drops what it cannot spell (newlines): key the gold queries by the prompts' round trip.
    gold = {codec.tokenizer.decode(codec.encode_prompt(e.prompt), skip_special_tokens=True): e.answer
            for e in examples}

    class Scripted(EngineAdapter):
        def generate(self, prompt_token_ids, sampling, seeds=None):
            out = []
            for i, p in enumerate(prompt_token_ids):
                text = codec.tokenizer.decode(p, skip_special_tokens=True)
                for j in range(sampling.n):
                    query = next(a for q, a in gold.items() if text.startswith(q))
                    action = (f"<sql>{query}</sql>" if "turns left" not in text else
                              f"<solution>{query if (prompt_seeds(sampling, seeds, len(prompt_token_ids))[i] + j) % 2 else 'SELECT 1'}</solution>")
                    ids = codec.tokenizer.encode(action, add_special_tokens=False) + [codec.eos_id]
                    out.append(Rollout(i, list(p), ids, [-0.1] * len(ids), "stop"))
            return out

        def update_weights(self, named_tensors):
            pass

        def close(self):
            pass

    summary, records = evaluate_examples(Scripted(), codec, examples, None, SamplingConfig(n=2, seed=1, max_tokens=256),
                                         ks=(1, 2), environment=EnvironmentConfig(name="sql", max_turns=3))
    assert summary["accuracy"] == 0.5 and summary["pass@2"] == 1.0 and summary["mean_turns"] == 2.0
    assert sorted(r["reward"] for r in records) == [0.0] * 3 + [1.0] * 3 and {r["finish"] for r in records} == {"done"}
    assert all("<observation>" in r["response"] and "2 turns left" in r["response"] for r in records)


def test_warm_start_traces_are_laid_out_exactly_as_the_driver_lays_out_trajectories(task, smollm2):
    """warmstart.trace_ids on a SqlTraceTask example == the driver's trajectory (ids and loss mask) when the
    engine samples the trace's assistant turns, with SmolLM2's chat template and the real SQL environment."""
    from portable_rl.engines.base import EngineAdapter, Rollout, SamplingConfig
    from portable_rl.rl.codec import TextCodec
    from portable_rl.rl.config import EnvironmentConfig
    from portable_rl.rl.turns import environment_factory, run_trajectories
    from portable_rl.warmstart import trace_ids

    codec = TextCodec(smollm2, chat_template=True)
    assert codec.eos_id == codec.tokenizer.convert_tokens_to_ids("<|im_end|>")  # a turn ends at EOS: no stop strings
    config = EnvironmentConfig(name="sql", max_turns=4, kwargs={"max_rows": 5})
    traces = SqlTraceTask(task, peek_probability=1.0, max_turns=4, environment_kwargs={"max_rows": 5})
    example = traces.train_batch(0, 0, 1)[0]
    replies = [codec.encode_response(t["content"]) for t in example.metadata["turns"] if t["role"] == "assistant"]

    class Replay(EngineAdapter):
        def generate(self, prompt_token_ids, sampling, seeds=None):
            turn = self.turn = getattr(self, "turn", -1) + 1
            return [Rollout(0, list(p), replies[turn], [-0.5] * len(replies[turn]), "stop") for p in prompt_token_ids]

        def update_weights(self, named_tensors):
            pass

        def close(self):
            pass

    question = task.train_batch(0, 0, 1)[0]  # the trace's question, its answer the gold SQL
    assert question.prompt == example.prompt
    (traj,), _ = run_trajectories(Replay(), codec, [question], environment_factory(config, None),
                                  SamplingConfig(n=1, seed=0, max_tokens=256), config)
    ids, mask = trace_ids(codec, example.metadata["turns"])
    assert traj.reward == 1.0 and traj.num_turns == 3 and traj.finish == "done"
    assert traj.rollout.prompt_token_ids == codec.encode_prompt(example.prompt)
    assert traj.rollout.response_token_ids == ids and traj.rollout.response_mask == mask
