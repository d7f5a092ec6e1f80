"""A kernel build killed mid-way leaves torch's lock file behind; the next build must not
wait on it (torch's build would, silently and forever), while a build under way in another
process is waited for. Reference: the flock a real child process holds, then is killed with
(no compiler runs here)."""
from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys

import pytest

from ember.kernels import BUILD_LOCK, build_lock, clear_dead_build_lock

# a builder: takes the build lock, writes torch's lock file as torch's build does, says so,
# then waits to be killed
BUILDER = """
import sys
from pathlib import Path
from ember.kernels import build_lock
folder = Path(sys.argv[1])
with build_lock(folder):
    (folder / "lock").touch()
    print("building", flush=True)
    sys.stdin.read()
"""


def locked_by_another(folder) -> bool:
    with open(folder / BUILD_LOCK, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(handle, fcntl.LOCK_UN)
        return False


@pytest.fixture
def builder(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", BUILDER, str(tmp_path)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert child.stdout.readline().strip() == "building"
    yield child
    child.kill()
    child.wait()


def test_a_build_under_way_holds_the_lock_and_a_killed_one_lets_go(tmp_path, builder):
    assert locked_by_another(tmp_path)          # a later build would wait for this one
    builder.send_signal(signal.SIGKILL)
    builder.wait()
    assert (tmp_path / "lock").exists()         # what a killed build leaves behind
    assert not locked_by_another(tmp_path)
    with build_lock(tmp_path):
        assert clear_dead_build_lock(tmp_path)
    assert not (tmp_path / "lock").exists()


def test_without_a_lock_file_there_is_nothing_to_clear(tmp_path):
    with build_lock(tmp_path / "fresh"):       # the build folder is made if absent
        assert not clear_dead_build_lock(tmp_path / "fresh")
        assert locked_by_another(tmp_path / "fresh")   # held until the block ends
    assert not locked_by_another(tmp_path / "fresh")
