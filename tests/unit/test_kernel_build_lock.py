"""A kernel build killed mid-way leaves torch's lock file behind; the next start must not
wait on it forever. Reference: the lock's age against STALE_LOCK_S (no build runs here)."""
from __future__ import annotations

import os

from ember.kernels import STALE_LOCK_S, clear_stale_build_lock


def make_lock(root, name: str, age_s: float, now: float):
    folder = root / name
    folder.mkdir(parents=True)
    lock = folder / "lock"
    lock.touch()
    os.utime(lock, (now - age_s, now - age_s))
    return lock


def test_a_lock_left_by_a_dead_build_is_removed(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    now = 1_000_000.0
    lock = make_lock(tmp_path, "ext", STALE_LOCK_S + 1, now)
    assert clear_stale_build_lock("ext", now=now)
    assert not lock.exists()


def test_a_build_in_progress_keeps_its_lock(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    now = 1_000_000.0
    lock = make_lock(tmp_path, "ext", 30, now)
    assert not clear_stale_build_lock("ext", now=now)
    assert lock.exists()
    assert not clear_stale_build_lock("other", now=now)  # no lock at all: nothing to do
