"""Text-to-SQL against a real SQLite database, in SkyRL-SQL's turn protocol.

Turns (at most `max_turns`; the example's `metadata["db_path"]` names the database, `answer` is the gold SQL):
- `<solution>S</solution>` ends the trajectory. Reward 1 when S's result set equals the gold query's, else 0.
- `<sql>Q</sql>` runs Q on the database. Reward 0; the next turn is
  `<observation>` + the result table or the error text + a `<reminder>` of the turns left + `</observation>`
  (SkyRL's layout, so a model trained there sees what it expects).
- Neither tag: an observation saying the turn was invalid, reward 0.
- The last allowed turn without a `<solution>` ends the trajectory with reward 0 (a format error).
The engine ends a turn at `</sql>` or `</solution>` (`stop_strings`, as SkyRL-SQL's sampling), keeping the tag in
the turn; a turn cut at max_tokens may lack its closing tag, and the text after the opening tag still counts.

Result equality: rows are compared as multisets (`Counter` of row tuples), or as ordered lists when the gold
query has ORDER BY; floats are rounded to 6 decimals; column order counts. A result larger than
`max_result_rows` never matches. SkyRL compares sets and scores a format error −1; here duplicates count and a
format error scores 0. `execution_reward` is the one scoring function: the environment and evaluation use it.

Execution safety (`ReadOnlyDatabase`): the file opens read-only (`file:…?mode=ro`, `PRAGMA query_only=ON`);
an authorizer lets only reads run (SELECT / WITH, functions, recursive CTEs, schema pragmas such as
`table_info`), so DROP, ATTACH and writable_schema are refused; a progress handler stops a query at its time
limit; one statement per call; the query text, any one string value, and the fetched rows (count and bytes)
are capped.
Every failure comes back as text in the observation; nothing the policy writes raises.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re
import sqlite3
import time
import urllib.parse
from typing import Any

from portable_rl.environments.base import Environment, Step, register_environment
from portable_rl.errors import ConfigError

_ALLOWED_ACTIONS = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION, sqlite3.SQLITE_RECURSIVE}
# Pragmas that only describe the schema; every other pragma (writable_schema, journal_mode, ...) is refused.
_SCHEMA_PRAGMAS = {"table_info", "table_xinfo", "table_list", "index_list", "index_info", "index_xinfo",
                   "foreign_key_list"}
# fts3_tokenizer('simple') returns a native pointer (an address leak); load_extension loads code (off anyway).
_DENIED_FUNCTIONS = {"fts3_tokenizer", "load_extension"}
_PROGRESS_OPCODES = 1000  # the time limit is checked every this many SQLite VM instructions (~tens of µs)
_FETCH_CHUNK = 256
_MAX_CELL_CHARS = 200  # a value longer than this is cut in an observation (the row still counts in full for the reward)
_ORDER_BY = re.compile(r"\border\s+by\b", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class QueryResult:
    columns: tuple[str, ...] = ()
    rows: tuple[tuple, ...] = ()
    complete: bool = True     # False: the query had more rows than were fetched (`rows` holds the first ones)
    error: str | None = None  # the error text shown to the policy; None on success


def _authorize(action, arg1, arg2, db_name, trigger):
    if action == sqlite3.SQLITE_FUNCTION and (arg2 or "").lower() in _DENIED_FUNCTIONS:
        return sqlite3.SQLITE_DENY
    if action in _ALLOWED_ACTIONS:
        return sqlite3.SQLITE_OK
    if action == sqlite3.SQLITE_PRAGMA and (arg1 or "").lower() in _SCHEMA_PRAGMAS:
        return sqlite3.SQLITE_OK
    return sqlite3.SQLITE_DENY


class ReadOnlyDatabase:
    """One read-only connection to a SQLite file; `execute` runs one statement under a time limit and never raises.

    Args:
      path: the .sqlite file (it must exist: opening read-only never creates it).
      timeout_s: wall-clock limit of one query, enforced by SQLite's progress handler.
      max_query_chars: longer query texts are refused before SQLite sees them.
      max_value_bytes: SQLite's length limit: no string or blob (a literal, a `group_concat`, a `zeroblob`)
        may be larger.
      max_result_bytes: fetching stops (the result is incomplete) once the fetched strings and blobs exceed this.
    """

    def __init__(self, path: str, *, timeout_s: float = 5.0, max_query_chars: int = 20_000,
                 max_value_bytes: int = 1_000_000, max_result_bytes: int = 16_000_000):
        if not os.path.isfile(path):
            raise ConfigError(f"SQL database {path!r} does not exist; point the example's metadata['db_path'] "
                              f"(or the task's db directory) at an existing .sqlite file")
        self.path, self.timeout_s, self.max_query_chars = path, timeout_s, max_query_chars
        self.max_result_bytes = max_result_bytes
        uri = "file:" + urllib.parse.quote(os.path.abspath(path)) + "?mode=ro"
        # The driver steps on a thread pool: a trajectory's steps may land on different threads (never two at once).
        self._conn = sqlite3.connect(uri, uri=True, check_same_thread=False, isolation_level=None)
        self._conn.execute("PRAGMA query_only=ON")
        # A TEXT value that is not UTF-8 is data to show, not a crash.
        self._conn.text_factory = lambda raw: raw.decode("utf-8", "replace")
        self._conn.setlimit(sqlite3.SQLITE_LIMIT_ATTACHED, 0)
        self._conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, max_value_bytes)
        self._conn.setlimit(sqlite3.SQLITE_LIMIT_SQL_LENGTH, 4 * max_query_chars)  # UTF-8 is at most 4 bytes a char
        self._conn.set_authorizer(_authorize)
        self._deadline = 0.0
        self._conn.set_progress_handler(lambda: time.monotonic() > self._deadline, _PROGRESS_OPCODES)

    def execute(self, sql: str, max_rows: int) -> QueryResult:
        """Runs `sql` (one statement) and fetches at most `max_rows` rows and `max_result_bytes` of text and blobs;
        errors come back in `QueryResult.error`."""
        if len(sql) > self.max_query_chars:
            return QueryResult(error=f"Error: the query is {len(sql)} characters long; the limit is "
                                     f"{self.max_query_chars}")
        try:
            sql.encode("utf-8")
        except UnicodeEncodeError:
            return QueryResult(error="Error: the query is not valid UTF-8 text")
        self._deadline = time.monotonic() + self.timeout_s
        cursor = self._conn.cursor()
        try:
            cursor.execute(sql)
            if cursor.description is None:  # an empty statement or a comment: no result to show or to score
                return QueryResult(error="Error: the statement is empty or returns no result")
            columns = tuple(d[0] for d in cursor.description)
            rows, size, complete = [], 0, True
            while chunk := cursor.fetchmany(min(_FETCH_CHUNK, max_rows + 1)):
                rows += chunk
                size += sum(len(v) for row in chunk for v in row if isinstance(v, (str, bytes)))
                if len(rows) > max_rows or size > self.max_result_bytes:
                    complete = False
                    break
        except sqlite3.OperationalError as e:
            if time.monotonic() > self._deadline and "interrupt" in str(e):
                return QueryResult(error=f"Error: the query ran past its {self.timeout_s:g} s time limit and was "
                                         f"stopped")
            return QueryResult(error=f"Error: {_explain(e)}")
        except (sqlite3.Error, sqlite3.Warning, ValueError, OverflowError, MemoryError) as e:
            # sqlite3.Warning / ProgrammingError: "You can only execute one statement at a time."
            return QueryResult(error=f"Error: {_explain(e)}")
        finally:
            cursor.close()
        return QueryResult(columns=columns, rows=tuple(rows[:max_rows]), complete=complete)

    def close(self) -> None:
        self._conn.close()


def _explain(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    if "not authorized" in text or "authorization denied" in text:
        return f"{text} (the database is read-only: only SELECT / WITH queries run)"
    return text


def format_observation(result: QueryResult, max_rows: int, max_bytes: int) -> str:
    """The result as a `col | col` table of at most `max_rows` rows and `max_bytes` UTF-8 bytes, or the error text;
    a last line says when rows were cut."""
    if result.error is not None:
        return result.error[:max_bytes]
    lines = [" | ".join(result.columns)]
    size = len(lines[0].encode())
    shown = 0
    for row in result.rows[:max_rows]:
        line = " | ".join(_cell(v) for v in row)
        size += len(line.encode()) + 1
        if size > max_bytes:
            break
        lines.append(line)
        shown += 1
    if shown < len(result.rows) or not result.complete:
        more = f"{len(result.rows)}" if result.complete else f"more than {len(result.rows)}"
        lines.append(f"(truncated: showing the first {shown} of {more} rows)")
    elif shown == 0:
        lines.append("(no rows)")
    return "\n".join(lines)


def _cell(value) -> str:
    text = "NULL" if value is None else str(value)
    return text if len(text) <= _MAX_CELL_CHARS else text[:_MAX_CELL_CHARS] + "…"


def _normalized(row: tuple) -> tuple:
    return tuple(round(v, 6) if isinstance(v, float) else v for v in row)


def results_match(predicted: QueryResult, gold: QueryResult, ordered: bool) -> bool:
    """Equal result sets: same rows as multisets (as lists when `ordered`); an error or a cut result never matches."""
    if predicted.error is not None or gold.error is not None or not (predicted.complete and gold.complete):
        return False
    p, g = [_normalized(r) for r in predicted.rows], [_normalized(r) for r in gold.rows]
    return p == g if ordered else collections.Counter(p) == collections.Counter(g)


def extract_tag(tag: str, text: str) -> str | None:
    """The text inside the first `<tag>...</tag>` (to the end of `text` if it is not closed), or None.
    str.find, not a regex: a 50 MB turn is scanned once, in C."""
    start = text.find(f"<{tag}>")
    if start < 0:
        return None
    start += len(tag) + 2
    end = text.find(f"</{tag}>", start)
    return text[start:end if end >= 0 else len(text)].strip()


def execution_reward(solution_sql: str | None, gold_sql: str, db: ReadOnlyDatabase, max_result_rows: int = 10_000,
                     gold: QueryResult | None = None) -> float:
    """1.0 when `solution_sql`'s result equals `gold_sql`'s on `db` (ordered iff the gold query has ORDER BY), else
    0.0; 0.0 when there is no solution (a format error). `gold` may pass the gold result already computed."""
    if solution_sql is None:
        return 0.0
    gold = gold if gold is not None else db.execute(gold_sql, max_result_rows)
    return float(results_match(db.execute(solution_sql, max_result_rows), gold, bool(_ORDER_BY.search(gold_sql))))


@register_environment("sql")
class SqlEnvironment(Environment):
    """SkyRL-SQL's text-to-SQL protocol on the example's SQLite file (see the module docstring).

    Args:
      max_turns: model turns allowed; the last one must hold the `<solution>` (SkyRL-SQL's recipe uses 6).
      query_timeout_s: the time limit of one query (the policy's and the gold one's).
      max_rows: rows shown in an observation.
      max_observation_bytes: UTF-8 bytes shown in an observation (the table is cut at a row boundary).
      max_query_chars: longer queries are refused.
      max_result_rows: rows fetched to score a solution; a larger result scores 0.
    """

    stop_strings = ("</sql>", "</solution>")

    def __init__(self, *, max_turns: int = 6, query_timeout_s: float = 5.0, max_rows: int = 50,
                 max_observation_bytes: int = 4000, max_query_chars: int = 20_000, max_result_rows: int = 10_000):
        if max_turns < 1:
            raise ConfigError(f"max_turns={max_turns} must be >= 1")
        if query_timeout_s <= 0:
            raise ConfigError(f"query_timeout_s={query_timeout_s} must be > 0")
        self.max_turns, self.query_timeout_s, self.max_rows = max_turns, query_timeout_s, max_rows
        self.max_observation_bytes, self.max_query_chars = max_observation_bytes, max_query_chars
        self.max_result_rows = max_result_rows
        self._db: ReadOnlyDatabase | None = None

    def reset(self, example) -> str | list[dict]:
        if "db_path" not in example.metadata:
            raise ConfigError("the SQL environment needs example.metadata['db_path']; build examples with "
                              "portable_rl.tasks.sql_data (SqlTask or read_skyrl_sql)")
        self.close()
        self._db = ReadOnlyDatabase(example.metadata["db_path"], timeout_s=self.query_timeout_s,
                                    max_query_chars=self.max_query_chars)
        self._gold_sql = example.answer
        self._turn = 0
        return example.metadata.get("messages") or example.prompt

    def step(self, action_text: str) -> Step:
        self._turn += 1
        info: dict[str, Any] = {"turn": self._turn}
        solution = extract_tag("solution", action_text)
        if solution is not None:
            gold = self._db.execute(self._gold_sql, self.max_result_rows)
            reward = execution_reward(solution, self._gold_sql, self._db, self.max_result_rows, gold=gold)
            return Step(None, reward, True, {**info, "action": "solution", "gold_error": gold.error})
        if self._turn >= self.max_turns:
            return Step(None, 0.0, True, {**info, "action": "none", "format_error": True})
        query = extract_tag("sql", action_text)
        if query is None:
            body = ("Your previous action is invalid: write one query inside <sql>...</sql> to explore, or the final "
                    "query inside <solution>...</solution>.")
            info.update(action="invalid")
        else:
            result = self._db.execute(query, self.max_rows)
            body = format_observation(result, self.max_rows, self.max_observation_bytes)
            info.update(action="sql", query_error=result.error is not None)
        left = self.max_turns - self._turn
        reminder = f"<reminder>You have {left} turn{'s' if left != 1 else ''} left to complete the task.</reminder>"
        return Step(f"<observation>\n{body}\n{reminder}\n</observation>", 0.0, False, info)

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None
