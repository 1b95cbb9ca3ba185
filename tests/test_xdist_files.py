"""The suite's two-worker schedule (tests/conftest.py + tests/xdist_files.py), run for real:
pytest -n 2 --dist loadfile on a throwaway suite whose files carry the real suite's names, with the real
conftest. Each file must run whole on one worker (its module fixture built once), the Ray files on the same
worker one after the other, and the slowest file first."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("xdist")

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
FILE = '''
import os, time, pytest

@pytest.fixture(scope="module")
def built():
    with open("fixtures.log", "a") as f:
        f.write(__name__ + "\\n")

@pytest.mark.parametrize("i", range(COUNT))
def test_x(i, built):
    with open("tests.log", "a") as f:
        f.write(f"{os.environ['PYTEST_XDIST_WORKER']} {__name__} {i}\\n")
    time.sleep(0.05)
'''
# test_d.py has the most tests: xdist's own order (most tests first) would send it out first.
COUNTS = {"test_d.py": 12}
NAMES = ["test_a.py", "test_engines_contract.py", "test_b.py", "test_engines_ray.py", "test_c.py",
         "test_smollm2_recipe.py", "test_d.py"]


def test_two_workers_run_each_file_whole_ray_files_together_slowest_first(tmp_path):
    shutil.copy(TESTS / "conftest.py", tmp_path / "conftest.py")
    shutil.copy(TESTS / "xdist_files.py", tmp_path / "xdist_files.py")  # the scheduler conftest.py imports
    for name in NAMES:
        (tmp_path / name).write_text(f"COUNT = {COUNTS.get(name, 4)}\n" + FILE)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadfile",
                           "-p", "no:cacheprovider", "--rootdir", str(tmp_path)], cwd=tmp_path,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = [line.split() for line in (tmp_path / "tests.log").read_text().splitlines()]
    assert len(rows) == sum(COUNTS.get(name, 4) for name in NAMES)
    worker_of = {}
    for worker, module, _ in rows:
        worker_of.setdefault(module, set()).add(worker)
    assert all(len(workers) == 1 for workers in worker_of.values()), worker_of  # each file on one worker
    assert len({w for ws in worker_of.values() for w in ws}) == 2  # and both workers used
    assert worker_of["test_engines_ray"] == worker_of["test_engines_contract"]
    built = (tmp_path / "fixtures.log").read_text().split()
    assert sorted(built) == sorted(name[:-3] for name in NAMES)  # each module fixture once
    on_ray_worker = [module for worker, module, _ in rows if {worker} == worker_of["test_engines_ray"]]
    ray_rows = [i for i, module in enumerate(on_ray_worker) if module.startswith("test_engines_")]
    assert ray_rows == list(range(ray_rows[0], ray_rows[0] + 8))  # the Ray files back to back
    # The units go out in SLOWEST_FIRST's order: the first two, one to each worker, are the recipe and Ray.
    first_on_worker = {}
    for worker, module, _ in rows:
        first_on_worker.setdefault(worker, module)
    assert sorted(first_on_worker.values()) == ["test_engines_ray", "test_smollm2_recipe"], first_on_worker
