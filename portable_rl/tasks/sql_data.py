"""Text-to-SQL examples for the SQL environment (`portable_rl.environments.sql`): generated offline, or SkyRL-SQL's.

An example is `Example(prompt, answer=gold SQL, metadata={"db_id", "db_path", ...})`; the environment runs
queries on `metadata["db_path"]` and scores the `<solution>` against `answer`.

**Generated** (`SqlTask`): schema families (shop, school, flights), each `num_databases` real SQLite files
filled with random rows from `np.random.default_rng([GENERATOR_VERSION, family, instance])`, written once to
`cache_dir/<family>_<instance>-v<GENERATOR_VERSION>.sqlite` (atomically; a later run reuses the file).
Questions come from templates at graded difficulty, level 1 filters, 2 aggregates, 3 joins / group by,
4 having / order by + limit, with values from the vocabularies the rows are drawn from; (seed, step, draw) fixes
a batch as in `GeneratedTask`, and the held-out prompts never appear in training. Columns a gold query orders by hold
distinct values, so an ORDER BY answer has one right order; a question whose gold result is empty or all NULL is
redrawn (any query returning nothing would match it).

**Values spelled by the database** (`SqlTask(spelled_values=True)`): each database stores the names its questions
use (cities, categories, departments, countries) its own way, one of `PARIS`, `PAR` or `Paris#37` per database and
column (the tag drawn per database), written to files of their own (`...-spelled.sqlite`). A question still says
"Paris"; its gold query uses the database's spelling, which only a query shows (`SELECT DISTINCT city FROM
customers`): questions the tool is needed for.

**SkyRL-SQL-653** (`read_skyrl_sql`, `SkyrlSqlTask`): parquet rows with `prompt` (chat messages: system
instructions, then the schema and question as the user turn), `db_id`, `data` (which corpus: synsql, spider,
bird), the gold SQL in `reward_spec.ground_truth` (the "newfmt" files; older files: `reward_model.ground_truth`)
and `data_source`. Databases live at `db_root/<corpus dir>/<db_id>/<db_id>.sqlite`, the OmniSQL layout SkyRL
reads: synsql → `SynSQL-2.5M/databases`, spider → `spider/database`, bird → `bird/train/train_databases`.

**Tool traces** (`tool_trace`, `SqlTraceTask`): question → `<sql>gold, or a peek at a table</sql>` → the real
observation from the environment → `<solution>gold</solution>`, for a supervised warm start of a policy too
small to write SQL zero-shot. A spelled question's trace first looks its values up (`SELECT DISTINCT column FROM
table`) instead of peeking.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
import sqlite3
import string
import tempfile
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np

from portable_rl.environments.sql import ReadOnlyDatabase, SqlEnvironment
from portable_rl.errors import ConfigError, UserError
from portable_rl.tasks.base import DatasetTask, Example, GeneratedTask

GENERATOR_VERSION = 1  # bump when the schemas, the fill or the templates change: the cache keys on it
DEFAULT_CACHE_DIR = os.path.join("~", ".cache", "portable_rl", "sql_databases")
_EVAL_STREAM = 2**31 - 1  # rng stream of the held-out set (training streams use step >= 0)
_SPACE_STREAM, _SPACE_SAMPLE = 2**31 - 2, 4000  # the sample that sizes the question space
_INSTRUCTIONS = ("Answer the question with one SQLite query. You may explore first: put one query inside "
                 "<sql>...</sql> and its result comes back inside <observation>...</observation>. Put the final "
                 "query inside <solution>...</solution>.")

_FIRST = ["Ada", "Ben", "Cleo", "Dan", "Eva", "Finn", "Gia", "Hugo", "Iris", "Jon", "Kai", "Lena", "Milo", "Nora",
          "Omar", "Pia", "Quin", "Rosa", "Sam", "Tara", "Uma", "Vic", "Wes", "Yara", "Zoe"]
_LAST = ["Adams", "Brown", "Chen", "Diaz", "Evans", "Fox", "Garcia", "Hill", "Ito", "Jones", "Khan", "Lopez",
         "Meyer", "Novak", "Olsen", "Patel", "Reyes", "Smith", "Tanaka", "Weber"]
_CITIES = ["Austin", "Berlin", "Cairo", "Delhi", "Lima", "Madrid", "Oslo", "Paris", "Rome", "Seoul", "Tokyo"]


def _names(rng: np.random.Generator, count: int) -> list[str]:
    pairs = rng.choice(len(_FIRST) * len(_LAST), size=count, replace=False)
    return [f"{_FIRST[p // len(_LAST)]} {_LAST[p % len(_LAST)]}" for p in pairs]


def _distinct(rng: np.random.Generator, low: int, high: int, count: int) -> list[int]:
    return [int(v) for v in rng.choice(np.arange(low, high), size=count, replace=False)]


def _pick(rng: np.random.Generator, values):
    return values[int(rng.integers(len(values)))]


# ---- schema families ----------------------------------------------------------------------------------------
# A family: its DDL, fill(rng) -> {table: rows}, samplers of the values its questions name (drawn from the same
# vocabularies as the fill, so they occur in the data), and its templates.


class Template(NamedTuple):
    level: int      # 1 filters, 2 aggregates, 3 joins / group by, 4 having / order by + limit
    question: str   # str.format fields name the family's value samplers; each is drawn once per question
    sql: str        # the gold query, with the same fields


class Family(NamedTuple):
    schema: str
    fill: Callable[[np.random.Generator], dict[str, list[tuple]]]
    values: dict[str, Callable[[np.random.Generator], object]]
    templates: list[Template]
    # the fields a database may spell its own way (`spelled_values`): field → (table, column, column index)
    spelled: dict[str, tuple[str, str, int]]


def fields_of(template: Template) -> list[str]:
    """The template's fields in the order its question names them."""
    return list(dict.fromkeys(name for _, name, _, _ in string.Formatter().parse(template.question) if name))


def render(family: Family, template: Template, rng: np.random.Generator,
           spelling: dict[str, Callable[[str], str]] | None = None) -> tuple[str, str]:
    """(question, gold SQL) with the template's fields drawn in the order the question names them; `spelling`:
    per spelled field, how the database stores a value (the gold query uses it, the question does not)."""
    values = {name: family.values[name](rng) for name in fields_of(template)}
    stored = {name: (spelling or {}).get(name, lambda v: v)(value) for name, value in values.items()}
    return template.question.format(**values), template.sql.format(**stored)


_CATEGORIES = ["books", "garden", "games", "kitchen", "music", "sports", "toys"]
_PRODUCT_WORDS = ["Alpha", "Bolt", "Cosmo", "Delta", "Echo", "Flux", "Giga", "Halo", "Ion", "Jet", "Koi", "Luna",
                  "Mesa", "Nova", "Orbit", "Pixel", "Quartz", "Rune", "Sol", "Terra", "Ultra", "Vibe", "Wave", "Zen"]


def _fill_shop(rng):
    n_cust, n_prod, n_ord = 40, 24, 160
    customers = [(i + 1, name, _pick(rng, _CITIES), int(rng.integers(18, 80)))
                 for i, name in enumerate(_names(rng, n_cust))]
    prices = _distinct(rng, 100, 20000, n_prod)  # cents, distinct: ORDER BY price has one answer
    products = [(i + 1, _PRODUCT_WORDS[i], _pick(rng, _CATEGORIES), prices[i] / 100) for i in range(n_prod)]
    orders = [(i + 1, int(rng.integers(1, n_cust + 1)), int(rng.integers(1, n_prod + 1)), int(rng.integers(1, 6)),
               f"2024-{int(rng.integers(1, 13)):02d}-{int(rng.integers(1, 29)):02d}") for i in range(n_ord)]
    return {"customers": customers, "products": products, "orders": orders}


_SHOP = Family(
    schema="""CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT, city TEXT, age INTEGER);
CREATE TABLE products (id INTEGER PRIMARY KEY, name TEXT, category TEXT, price REAL);
CREATE TABLE orders (id INTEGER PRIMARY KEY, customer_id INTEGER REFERENCES customers(id),
  product_id INTEGER REFERENCES products(id), quantity INTEGER, order_date TEXT);""",
    fill=_fill_shop,
    spelled={"city": ("customers", "city", 2), "category": ("products", "category", 2)},
    values={"city": lambda rng: _pick(rng, _CITIES), "category": lambda rng: _pick(rng, _CATEGORIES),
            "age": lambda rng: int(rng.integers(25, 70)), "k": lambda rng: int(rng.integers(2, 9)),
            "n": lambda rng: int(rng.integers(2, 6))},
    templates=[
        Template(1, "How many customers live in {city}?", "SELECT COUNT(*) FROM customers WHERE city = '{city}'"),
        Template(1, "List the names of the products in the {category} category.",
                 "SELECT name FROM products WHERE category = '{category}'"),
        Template(1, "What are the names of the customers older than {age}?",
                 "SELECT name FROM customers WHERE age > {age}"),
        Template(2, "What is the average price of the products in the {category} category?",
                 "SELECT AVG(price) FROM products WHERE category = '{category}'"),
        Template(2, "What is the age of the oldest customer in {city}?",
                 "SELECT MAX(age) FROM customers WHERE city = '{city}'"),
        Template(3, "List the distinct names of the customers who ordered a product in the {category} category.",
                 "SELECT DISTINCT customers.name FROM customers JOIN orders ON orders.customer_id = customers.id "
                 "JOIN products ON products.id = orders.product_id WHERE products.category = '{category}'"),
        Template(3, "For each category, how many products does it have? Give the category and the count.",
                 "SELECT category, COUNT(*) FROM products GROUP BY category"),
        Template(3, "What is the total quantity ordered by customers who live in {city}?",
                 "SELECT SUM(orders.quantity) FROM orders JOIN customers ON customers.id = orders.customer_id "
                 "WHERE customers.city = '{city}'"),
        Template(4, "What are the names of the {k} most expensive products, most expensive first?",
                 "SELECT name FROM products ORDER BY price DESC LIMIT {k}"),
        Template(4, "Which cities have more than {n} customers?",
                 "SELECT city FROM customers GROUP BY city HAVING COUNT(*) > {n}"),
    ])

_DEPARTMENTS = ["art", "biology", "chemistry", "history", "math", "physics"]
_TOPICS = ["Algebra", "Botany", "Ceramics", "Dynamics", "Ecology", "Frescoes", "Genetics", "Harmony", "Optics",
           "Painting", "Quanta", "Reactions", "Statistics", "Topology", "Wars", "Empires"]


def _fill_school(rng):
    n_stu, n_crs, n_enr = 45, len(_TOPICS), 180
    students = [(i + 1, name, int(rng.integers(1, 5)), _pick(rng, _CITIES))
                for i, name in enumerate(_names(rng, n_stu))]
    courses = [(i + 1, _TOPICS[i], _pick(rng, _DEPARTMENTS), int(rng.integers(1, 6))) for i in range(n_crs)]
    enrollments = [(i + 1, int(rng.integers(1, n_stu + 1)), int(rng.integers(1, n_crs + 1)), int(rng.integers(40, 101)))
                   for i in range(n_enr)]
    return {"students": students, "courses": courses, "enrollments": enrollments}


_SCHOOL = Family(
    schema="""CREATE TABLE students (id INTEGER PRIMARY KEY, name TEXT, year INTEGER, city TEXT);
CREATE TABLE courses (id INTEGER PRIMARY KEY, title TEXT, department TEXT, credits INTEGER);
CREATE TABLE enrollments (id INTEGER PRIMARY KEY, student_id INTEGER REFERENCES students(id),
  course_id INTEGER REFERENCES courses(id), score INTEGER);""",
    fill=_fill_school,
    spelled={"city": ("students", "city", 3), "department": ("courses", "department", 2)},
    values={"year": lambda rng: int(rng.integers(1, 5)), "department": lambda rng: _pick(rng, _DEPARTMENTS),
            "city": lambda rng: _pick(rng, _CITIES), "course": lambda rng: _pick(rng, _TOPICS),
            "k": lambda rng: int(rng.integers(2, 9)), "n": lambda rng: int(rng.integers(8, 14))},
    templates=[
        Template(1, "How many students are in year {year}?", "SELECT COUNT(*) FROM students WHERE year = {year}"),
        Template(1, "List the titles of the courses of the {department} department.",
                 "SELECT title FROM courses WHERE department = '{department}'"),
        Template(1, "What are the names of the students from {city}?",
                 "SELECT name FROM students WHERE city = '{city}'"),
        Template(2, "How many credits do the courses of the {department} department give in total?",
                 "SELECT SUM(credits) FROM courses WHERE department = '{department}'"),
        Template(2, "What is the average score over all enrollments?", "SELECT AVG(score) FROM enrollments"),
        Template(3, "List the distinct names of the students enrolled in {course}.",
                 "SELECT DISTINCT students.name FROM students JOIN enrollments ON enrollments.student_id = students.id "
                 "JOIN courses ON courses.id = enrollments.course_id WHERE courses.title = '{course}'"),
        Template(3, "For each year, how many students are in it? Give the year and the count.",
                 "SELECT year, COUNT(*) FROM students GROUP BY year"),
        Template(3, "What is the highest score in {course}?",
                 "SELECT MAX(enrollments.score) FROM enrollments JOIN courses ON courses.id = enrollments.course_id "
                 "WHERE courses.title = '{course}'"),
        Template(4, "What are the titles of the first {k} courses in alphabetical order?",
                 "SELECT title FROM courses ORDER BY title LIMIT {k}"),
        Template(4, "Which course titles have more than {n} enrollments?",
                 "SELECT courses.title FROM courses JOIN enrollments ON enrollments.course_id = courses.id "
                 "GROUP BY courses.id HAVING COUNT(*) > {n}"),
    ])

_AIRPORTS = [("AUS", "Austin", "USA"), ("BER", "Berlin", "Germany"), ("CAI", "Cairo", "Egypt"),
             ("DEL", "Delhi", "India"), ("LIM", "Lima", "Peru"), ("MAD", "Madrid", "Spain"), ("OSL", "Oslo", "Norway"),
             ("CDG", "Paris", "France"), ("FCO", "Rome", "Italy"), ("ICN", "Seoul", "Korea"), ("HND", "Tokyo", "Japan")]
_AIRLINES = [("Aero Blue", "USA"), ("Borealis", "Norway"), ("Condor Way", "Peru"), ("Danube Air", "Germany"),
             ("Eastwind", "Korea"), ("Fuji Sky", "Japan"), ("Gala Air", "Spain"), ("Indus Jet", "India")]


def _fill_flights(rng):
    n_fl = 120
    distances = _distinct(rng, 300, 12000, n_fl)  # distinct: ORDER BY distance has one answer
    flights = []
    for i in range(n_fl):
        o, dst = rng.choice(len(_AIRPORTS), size=2, replace=False)
        flights.append((i + 1, int(rng.integers(1, len(_AIRLINES) + 1)), _AIRPORTS[o][0], _AIRPORTS[dst][0],
                        distances[i], round(float(rng.integers(5000, 150000)) / 100, 2)))
    return {"airports": list(_AIRPORTS), "airlines": [(i + 1, *a) for i, a in enumerate(_AIRLINES)], "flights": flights}


_FLIGHTS = Family(
    schema="""CREATE TABLE airports (code TEXT PRIMARY KEY, city TEXT, country TEXT);
CREATE TABLE airlines (id INTEGER PRIMARY KEY, name TEXT, country TEXT);
CREATE TABLE flights (id INTEGER PRIMARY KEY, airline_id INTEGER REFERENCES airlines(id),
  origin TEXT REFERENCES airports(code), destination TEXT REFERENCES airports(code), distance INTEGER, price REAL);""",
    fill=_fill_flights,
    spelled={"city": ("airports", "city", 1), "country": ("airlines", "country", 2)},
    values={"airport": lambda rng: _pick(rng, _AIRPORTS)[0], "city": lambda rng: _pick(rng, _AIRPORTS)[1],
            "country": lambda rng: _pick(rng, _AIRLINES)[1], "airline": lambda rng: _pick(rng, _AIRLINES)[0],
            "km": lambda rng: int(rng.integers(2000, 10000)), "k": lambda rng: int(rng.integers(2, 9)),
            "n": lambda rng: int(rng.integers(10, 16))},
    templates=[
        Template(1, "How many flights leave from the airport {airport}?",
                 "SELECT COUNT(*) FROM flights WHERE origin = '{airport}'"),
        Template(1, "What are the ids of the flights longer than {km} km?",
                 "SELECT id FROM flights WHERE distance > {km}"),
        Template(1, "List the names of the airlines based in {country}.",
                 "SELECT name FROM airlines WHERE country = '{country}'"),
        Template(2, "What is the average price of the flights to {airport}?",
                 "SELECT AVG(price) FROM flights WHERE destination = '{airport}'"),
        Template(2, "What is the longest distance flown by a flight from {airport}?",
                 "SELECT MAX(distance) FROM flights WHERE origin = '{airport}'"),
        Template(3, "How many flights does {airline} operate?",
                 "SELECT COUNT(*) FROM flights JOIN airlines ON airlines.id = flights.airline_id "
                 "WHERE airlines.name = '{airline}'"),
        Template(3, "What are the ids of the flights that arrive in the city of {city}?",
                 "SELECT flights.id FROM flights JOIN airports ON airports.code = flights.destination "
                 "WHERE airports.city = '{city}'"),
        Template(3, "For each origin airport, how many flights leave from it? Give the code and the count.",
                 "SELECT origin, COUNT(*) FROM flights GROUP BY origin"),
        Template(4, "What are the ids of the {k} shortest flights, shortest first?",
                 "SELECT id FROM flights ORDER BY distance LIMIT {k}"),
        Template(4, "Which airline names operate more than {n} flights?",
                 "SELECT airlines.name FROM airlines JOIN flights ON flights.airline_id = airlines.id "
                 "GROUP BY airlines.id HAVING COUNT(*) > {n}"),
    ])

FAMILIES: dict[str, Family] = {"shop": _SHOP, "school": _SCHOOL, "flights": _FLIGHTS}
LEVELS = (1, 2, 3, 4)


def spelling(family: str, instance: int) -> dict[str, Callable[[str], str]]:
    """How database (family, instance) spells each of its family's spelled fields (module doc): PARIS, PAR
    (the first three letters; unique within every vocabulary) or Paris#<tag>, drawn per database and field."""
    rng = np.random.default_rng([GENERATOR_VERSION, list(FAMILIES).index(family), instance, 7])
    spellings = {}
    for field in FAMILIES[family].spelled:
        kind, tag = int(rng.integers(3)), int(rng.integers(10, 100))
        spellings[field] = (str.upper, lambda v: v[:3].upper(), lambda v, tag=tag: f"{v}#{tag}")[kind]
    return spellings


def database_path(cache_dir: str, family: str, instance: int, spelled: bool = False) -> str:
    """The cached SQLite file of (family, instance), written on first use; its content depends only on them,
    `spelled` (the values spelled the database's way: `spelling`) and GENERATOR_VERSION."""
    directory = Path(os.path.expanduser(cache_dir))
    path = directory / f"{family}_{instance}-v{GENERATOR_VERSION}{'-spelled' if spelled else ''}.sqlite"
    if path.exists():
        return str(path)
    directory.mkdir(parents=True, exist_ok=True)
    rows = FAMILIES[family].fill(np.random.default_rng([GENERATOR_VERSION, list(FAMILIES).index(family), instance]))
    if spelled:
        for field, spell in spelling(family, instance).items():
            table, _, column = FAMILIES[family].spelled[field]
            rows[table] = [row[:column] + (spell(row[column]),) + row[column + 1:] for row in rows[table]]
    fd, tmp = tempfile.mkstemp(dir=directory, suffix=".sqlite.tmp")
    os.close(fd)
    try:
        conn = sqlite3.connect(tmp)
        conn.executescript(FAMILIES[family].schema)
        for table, table_rows in rows.items():
            conn.executemany(f"INSERT INTO {table} VALUES ({', '.join('?' * len(table_rows[0]))})", table_rows)
        conn.commit()
        conn.close()
        os.replace(tmp, path)  # atomic: a reader never sees half a file; a concurrent writer wrote the same bytes
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return str(path)


@functools.lru_cache(maxsize=None)
def _has_answer(db_path: str, sql: str) -> bool:
    """The query returns a row with a non-NULL value. A question whose gold result is empty (no product in that
    category) is redrawn: any query that returns nothing would score 1 on it."""
    db = ReadOnlyDatabase(db_path)
    try:
        result = db.execute(sql, max_rows=1)
    finally:
        db.close()
    return result.error is None and any(v is not None for row in result.rows for v in row)


def generated_prompt(schema: str, question: str) -> str:
    return f"Database schema (SQLite):\n{schema}\n\nQuestion: {question}\n\n{_INSTRUCTIONS}"


@dataclasses.dataclass
class SqlTask(GeneratedTask):
    """Generated text-to-SQL questions on cached random SQLite databases (module doc: families, levels, cache).

    Attributes:
      families: the schema families drawn from, uniformly per question (of "shop", "school", "flights").
      levels: the difficulty levels drawn from, uniformly per question: 1 filters, 2 aggregates, 3 joins /
        group by, 4 having / order by + limit.
      num_databases: random databases per family; a question's database is drawn uniformly (more databases:
        more distinct questions, the same question with other answers).
      spelled_values: each database spells the names its questions use its own way (module doc): the gold
        query needs the database's spelling, which only a query shows.
      cache_dir: where the database files are written once and reused.
      seed: the seed of the held-out set and of every training batch.
      num_eval: held-out questions; training never draws their prompts.
      name: the task's name in evaluation reports.
    """
    families: tuple[str, ...] = ("shop", "school", "flights")
    levels: tuple[int, ...] = LEVELS
    num_databases: int = 4
    spelled_values: bool = False
    cache_dir: str = DEFAULT_CACHE_DIR
    seed: int = 0
    num_eval: int = 100
    name: str = "sql"
    # No text reward: the SQL environment scores a trajectory by execution (rl.EnvironmentConfig.name = 'sql').
    reward = None

    def __post_init__(self):
        self.families, self.levels = tuple(self.families), tuple(self.levels)
        unknown = sorted(set(self.families) - set(FAMILIES))
        if not self.families or unknown:
            raise ConfigError(f"families={self.families!r} has unknown families {unknown}; use a non-empty subset "
                              f"of {sorted(FAMILIES)}")
        if not self.levels or set(self.levels) - set(LEVELS):
            raise ConfigError(f"levels={self.levels!r} must be a non-empty subset of {LEVELS}")
        if self.num_databases < 1:
            raise ConfigError(f"num_databases={self.num_databases} must be >= 1")
        self._databases = {(f, i): database_path(self.cache_dir, f, i, self.spelled_values)
                           for f in self.families for i in range(self.num_databases)}
        self._spellings = {(f, i): spelling(f, i) if self.spelled_values else {}
                           for f in self.families for i in range(self.num_databases)}
        self._templates = [(f, t) for f in self.families for t in FAMILIES[f].templates if t.level in self.levels]
        # The question space is small for narrow settings (one family, one level): a held-out set that covered it
        # would leave training nothing to draw. Count the distinct prompts of a sample (a lower bound of the space).
        sample = np.random.default_rng([self.seed, _SPACE_STREAM])
        distinct = len({self._problem(sample).prompt for _ in range(_SPACE_SAMPLE)})
        if self.num_eval > distinct // 4:
            raise ConfigError(f"num_eval={self.num_eval} is more than a quarter of the {distinct} distinct questions "
                              f"these families / levels / num_databases give; lower num_eval or widen them")
        self._init_held_out(self.seed, _EVAL_STREAM, self.num_eval)

    def _problem(self, rng: np.random.Generator) -> Example:
        while True:
            family, template = self._templates[int(rng.integers(len(self._templates)))]
            instance = int(rng.integers(self.num_databases))
            question, gold = render(FAMILIES[family], template, rng, self._spellings[(family, instance)])
            if _has_answer(self._databases[(family, instance)], gold):
                break
        db_id = f"{family}_{instance}"
        # the lookups that show how this database spells the question's values (the tool traces make them)
        lookups = [f"SELECT DISTINCT {column} FROM {table}" for field in fields_of(template)
                   if field in self._spellings[(family, instance)]
                   for table, column, _ in [FAMILIES[family].spelled[field]]]
        # The db_id is part of the prompt so the same question on two databases is two distinct prompts.
        return Example(prompt=generated_prompt(FAMILIES[family].schema, f"{question} (database {db_id})"), answer=gold,
                       metadata={"db_id": db_id, "db_path": self._databases[(family, instance)],
                                 "level": template.level, "lookups": lookups})


# ---- SkyRL-SQL-653 ------------------------------------------------------------------------------------------

SKYRL_CORPUS_DIRS = {"synsql": "SynSQL-2.5M/databases", "spider": "spider/database",
                     "bird": "bird/train/train_databases"}


class SqlDataError(UserError, ValueError):
    """A SkyRL-SQL parquet file or database directory that cannot be used."""


def _gold_sql(row: dict) -> str | None:
    for key in ("reward_spec", "reward_model"):  # "newfmt" files, then the original ones
        spec = row.get(key)
        if isinstance(spec, dict) and isinstance(spec.get("ground_truth"), str) and spec["ground_truth"].strip():
            return spec["ground_truth"]
    return None


def read_skyrl_sql(parquet_path: str, db_root: str) -> tuple[list[Example], collections.Counter]:
    """SkyRL-SQL parquet rows → (examples, Counter of skipped rows by reason); module doc: columns, db layout.

    The prompt's chat messages go to `metadata["messages"]` (the environment's first prompt, as published);
    `Example.prompt` is the last user turn's text."""
    import pyarrow.parquet as pq

    path = Path(parquet_path)
    if not path.is_file():
        raise FileNotFoundError(f"SkyRL-SQL data {path} does not exist; download NovaSky-AI/SkyRL-SQL-653-data-newfmt "
                                f"and point the task's train_path / eval_path at its parquet files")
    if not Path(db_root).is_dir():
        raise FileNotFoundError(f"database directory {db_root} does not exist; unzip OmniSQL's data.zip and set "
                                f"db_root to the folder holding {sorted(set(SKYRL_CORPUS_DIRS.values()))}")
    examples, skipped = [], collections.Counter()
    for row in pq.read_table(path).to_pylist():
        messages, db_id, gold = row.get("prompt"), row.get("db_id"), _gold_sql(row)
        corpus = row.get("data") or row.get("data_source")
        if not (isinstance(messages, list) and messages and all(isinstance(m, dict) for m in messages)):
            skipped["bad_prompt"] += 1
            continue
        if not db_id or gold is None:
            skipped["missing_db_id_or_gold_sql"] += 1
            continue
        if corpus not in SKYRL_CORPUS_DIRS:
            skipped["unknown_corpus"] += 1
            continue
        db_path = os.path.join(db_root, SKYRL_CORPUS_DIRS[corpus], db_id, f"{db_id}.sqlite")
        if not os.path.isfile(db_path):
            skipped["missing_database"] += 1
            continue
        users = [m["content"] for m in messages if m.get("role") == "user"]
        examples.append(Example(prompt=users[-1] if users else messages[-1]["content"], answer=gold, metadata={
            "db_id": db_id, "db_path": db_path, "data_source": row.get("data_source", corpus), "messages": messages}))
    if not examples:
        raise SqlDataError(f"no usable row in {path} (skipped: {dict(skipped)}); check db_root={db_root!r} holds "
                           f"<corpus dir>/<db_id>/<db_id>.sqlite and the rows have prompt, db_id, data and "
                           f"reward_spec.ground_truth")
    return examples, skipped


@dataclasses.dataclass
class SkyrlSqlTask(DatasetTask):
    """SkyRL-SQL-653 (train.parquet / validation.parquet) with its databases; scored by the SQL environment.

    Attributes:
      train_path: the training parquet.
      eval_path: the held-out parquet (its first num_eval usable rows).
      db_root: the OmniSQL data folder (holding SynSQL-2.5M/databases, spider/database, ...).
      num_eval: held-out examples.
      seed: the seed of the training batches (rows drawn without replacement within a batch).
      name: the task's name in evaluation reports.
    """
    train_path: str
    eval_path: str
    db_root: str
    num_eval: int = 1024
    seed: int = 0
    name: str = "skyrl_sql"
    # No text reward: the SQL environment scores a trajectory by execution (rl.EnvironmentConfig.name = 'sql').
    reward = None

    def __post_init__(self):
        self._train, train_skipped = read_skyrl_sql(self.train_path, self.db_root)
        held_out, eval_skipped = read_skyrl_sql(self.eval_path, self.db_root)
        self._eval = held_out[: self.num_eval]
        skipped = train_skipped + eval_skipped
        self.skipped_reasons = dict(sorted(skipped.items()))
        self.skipped_rows = sum(skipped.values())


# ---- synthetic tool traces ----------------------------------------------------------------------------------

def tool_trace(example: Example, rng: np.random.Generator, peek_probability: float = 0.5,
               max_turns: int = 6, **environment_kwargs) -> list[dict]:
    """A correct trajectory for a generated `example` as chat turns: assistant `<sql>` (the gold query, or with
    `peek_probability` first a look at its first table), user observation (the real one, from a `SqlEnvironment`
    of `max_turns` turns and `environment_kwargs`, so the reminders and tables match training), ..., assistant
    `<solution>gold</solution>`. The solution needs the last turn, so `max_turns` 2 never peeks and `max_turns` 1
    answers at once without the tool (the no-tool ablation's warm start). A spelled question (`metadata["lookups"]`)
    looks its values up instead of peeking, before the gold query when the turns leave room for it."""
    peek = rng.random() < peek_probability  # drawn whatever max_turns is: the same traces for every max_turns >= 3
    queries = [] if max_turns == 1 else [example.answer]
    lookups = example.metadata.get("lookups", [])
    if lookups:  # a spelled question: look the values up first, as many queries as the turns leave room for
        queries = (lookups + queries)[:max_turns - 1]
    elif peek and max_turns >= 3:
        table = example.answer.split(" FROM ", 1)[1].split()[0]
        queries.insert(0, f"SELECT * FROM {table} LIMIT 3")
    env = SqlEnvironment(max_turns=max_turns, **environment_kwargs)
    env.reset(example)
    turns = []
    try:
        for query in queries:
            action = f"<sql>{query}</sql>"
            turns += [{"role": "assistant", "content": action},
                      {"role": "user", "content": env.step(action).observation}]
        turns.append({"role": "assistant", "content": f"<solution>{example.answer}</solution>"})
    finally:
        env.close()
    return turns


@dataclasses.dataclass
class SqlTraceTask:
    """`SqlTask`'s questions with whole tool traces (`tool_trace`) for `portable_rl.warmstart`: the chat turns after
    the prompt in `metadata["turns"]` (the warm start lays them out as the multi-turn driver does, loss on the
    assistant turns only), the turns' texts joined by newlines as the answer.

    Attributes:
      sql_task: the generated task whose questions and databases are used.
      peek_probability: the share of traces that look at the table before querying.
      max_turns: the environment's turn limit the traces' reminders count down from: the RL run's
        `rl.EnvironmentConfig.max_turns`; 1 gives traces that answer without the tool.
      environment_kwargs: the SQL environment's other settings (`max_rows`, ...): the RL run's
        `rl.EnvironmentConfig.kwargs`, so the traces' observations are the ones training shows.
      reward: the registered text reward a single-turn scorer would use: the whole trace, verbatim.
      name: the task's name in reports.
    """
    sql_task: SqlTask
    peek_probability: float = 0.5
    max_turns: int = 6
    environment_kwargs: dict = dataclasses.field(default_factory=dict)
    reward: str = "exact_match"
    name: str = "sql_traces"

    def train_batch(self, step: int, draw: int, batch_size: int) -> list[Example]:
        rng = np.random.default_rng([self.sql_task.seed, step, draw, 1])  # its own stream: not the questions' draws
        return [self._traced(ex, rng) for ex in self.sql_task.train_batch(step, draw, batch_size)]

    def eval_examples(self) -> list[Example]:
        rng = np.random.default_rng([self.sql_task.seed, _EVAL_STREAM, 1])
        return [self._traced(ex, rng) for ex in self.sql_task.eval_examples()]

    def _traced(self, example: Example, rng: np.random.Generator) -> Example:
        turns = tool_trace(example, rng, self.peek_probability, self.max_turns, **dict(self.environment_kwargs))
        return dataclasses.replace(example, answer="\n".join(turn["content"] for turn in turns),
                                   metadata={**example.metadata, "turns": turns})
