"""A pytest-xdist scheduler for this test suite: one work unit per test file, some files sharing one unit.

Used with `pytest -n 2 --dist loadfile` (tests/conftest.py registers it). Why not xdist's own modes:
- `--dist loadgroup` (an `xdist_group` marker per file) silently stopped grouping with pytest 9: xdist 3.8
  tags each test's node id (`item._nodeid += "@group"`), and pytest 9 reads node ids from elsewhere, so every
  test was scheduled alone (pytest-xdist issue #1386, open). A module-scoped fixture (a warm start, an
  engine, the multi-host launches) was then built once per worker that got a test of its file (the
  multi-host fixture, ~280 s, twice).
- `--dist loadfile` groups by file without touching node ids, but each file is its own unit, and files
  that start a local Ray cluster must not run at the same time on two workers.
So: `loadfile`, with the files in `shared_units` mapped to one unit name, and units handed out in collection
order (not xdist's default of most tests first), which tests/conftest.py sets to slowest file first, so the
session does not end with one long file running alone.
"""

from pathlib import PurePosixPath

from xdist.scheduler import LoadFileScheduling


def file_scheduler(shared_units: dict[str, str]):
    """A LoadFileScheduling class whose unit for a test is `shared_units.get(file name, file path)`."""

    class FileScheduling(LoadFileScheduling):
        def __init__(self, config, log=None):
            super().__init__(config, log)
            config.option.loadscopereorder = False  # hand units out in collection order

        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return shared_units.get(PurePosixPath(path).name, path)

    return FileScheduling
