"""The user docs agree with the repository: every benchmark row names its raw data, and every gin name the
docs mention is one the code accepts. Plain text checks; no model, engine or JAX compile."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
NOT_KEPT = "raw data not kept"
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _benchmark_rows():
    """(line number, cells) of every data row of docs/benchmarks.md's table(s) that have a 'raw data' column."""
    rows, header = [], None
    for number, line in enumerate((DOCS / "benchmarks.md").read_text().splitlines(), 1):
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = cells
        elif not set(line) <= set("|-: "):
            rows.append((number, dict(zip(header, cells))))
    return rows


def test_every_benchmark_row_links_its_raw_data_or_says_it_was_not_kept():
    rows = _benchmark_rows()
    assert len(rows) >= 20, "docs/benchmarks.md's table was not found"
    problems = []
    for number, row in rows:
        cell = row.get("raw data")
        if cell is None:
            problems.append(f"benchmarks.md:{number}: no 'raw data' column")
            continue
        links = [target for target in _LINK.findall(cell) if not target.startswith(("http://", "https://"))]
        if not links and NOT_KEPT not in cell:
            problems.append(f"benchmarks.md:{number}: neither a raw-data link nor '{NOT_KEPT}'")
        for target in links:
            path = (DOCS / target.split("#")[0]).resolve()
            if not path.is_file():
                problems.append(f"benchmarks.md:{number}: {target} does not exist")
            elif not (path.is_relative_to(DOCS / "data") and path.suffix in (".json", ".jsonl")):
                problems.append(f"benchmarks.md:{number}: {target} is not a JSON/JSONL file under docs/data/")
    assert not problems, "\n".join(problems)


def _reference_knobs() -> dict[str, set[str]]:
    """owner → knobs, from the generated docs/reference/configuration.md (kept current by
    tests/test_config_reference.py)."""
    owners, current = {}, None
    for line in (DOCS / "reference" / "configuration.md").read_text().splitlines():
        if m := re.match(r"## `([^`]+)`", line):
            current = owners.setdefault(m.group(1), set())
        elif (m := re.match(r"\| `([^`]+)` \|", line)) and current is not None:
            current.add(m.group(1))
    return owners


# `owner.knob` not preceded by a word, dot or slash (so `portable_rl.train.cli`, `time/train` and paths do not
# match) and not called (methods such as `RolloutCorrectionConfig.preset(...)`).
_GIN_NAME = re.compile(r"(?<![\w./-])((?:[a-z_][a-z0-9_]*\.)*[A-Za-z_][A-Za-z0-9_]*)\.([a-z_][a-z0-9_]*)\b(?![(\w])")


# The same names as command-line bindings: --gin.rl.LossConfig.clip_eps_high=0.3.
_GIN_FLAG = re.compile(r"--gin\.((?:[a-z_][a-z0-9_]*\.)*[A-Za-z_][A-Za-z0-9_]*)\.([a-z_][a-z0-9_]*)\b")


def _user_docs():
    return [p for p in sorted(DOCS.glob("**/*.md")) if "reference" not in p.parts]


def _module_defines(owner: str, name: str) -> bool:
    """A function configurable shares its name with a module (`train`): `train.cli` / `train.py` name the
    module's own function or file, not a knob."""
    module = ROOT / "portable_rl" / (owner.replace(".", "/") + ".py")
    return name == "py" or (module.is_file() and re.search(rf"^(def |class )?{name}\b", module.read_text(), re.M)
                                                          is not None)


def test_every_gin_name_in_the_docs_is_a_real_knob():
    from portable_rl import gin_utils

    owners = _reference_knobs()
    assert "rl.DapoConfig" in owners and "learner_jax.MemoryConfig" in owners
    moved = {**gin_utils.MOVED, **gin_utils.moved_dapo_fields()}
    problems = []
    for path in _user_docs():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for m in [*_GIN_NAME.finditer(line), *_GIN_FLAG.finditer(line)]:
                owner, knob = m.groups()
                name = f"{owner}.{knob}"
                where = f"{path.relative_to(ROOT)}:{number}: {name}"
                if name in moved:
                    problems.append(f"{where} is rejected by the code; it is {moved[name]}")
                elif owner in owners and knob not in owners[owner] and not _module_defines(owner, knob):
                    problems.append(f"{where}: {owner} has no knob {knob!r}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("text,expected", [
    ("set `rl.LossConfig.clip_eps_high = 0.28`", [("rl.LossConfig", "clip_eps_high")]),
    ("see portable_rl.train.cli and time/train.x", [("portable_rl.train", "cli")]),  # whole dotted name
    ("`tis.RolloutCorrectionConfig.preset('x')`", []),
])
def test_gin_name_pattern(text, expected):
    assert [m.groups() for m in _GIN_NAME.finditer(text)] == expected


def test_every_macro_the_docs_pass_is_one_a_gin_file_defines():
    """`--gin.MACRO=…` in the docs names a macro some file under gin/ binds (`MACRO = …`); gin ignores a macro
    that nothing reads, so a misspelt or removed one would be silently dropped."""
    defined = set()
    for path in (ROOT / "gin").glob("**/*.gin"):
        defined |= set(re.findall(r"^([A-Z][A-Z0-9_]*)\s*=", path.read_text(), re.M))
    problems = []
    for path in _user_docs() + [ROOT / "README.md"]:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for macro in re.findall(r"--gin\.([A-Z][A-Z0-9_]*)\b", line):
                if macro not in defined and macro != "NAME":  # NAME: the placeholder of --gin.NAME=VALUE
                    problems.append(f"{path.relative_to(ROOT)}:{number}: --gin.{macro} is defined by no gin file")
    assert not problems, "\n".join(problems)
