"""A start with the kernels built imports them as they are, without torch's build step (which
runs ninja), and a change to any source, a header included, goes through the build again."""
from __future__ import annotations

import shutil
import sys

import pytest
import torch.utils.cpp_extension

from ember.kernels import SOURCE, build_cpu_ops, default_name


class Rebuilt(Exception):
    pass


def refuse_build(**options: object) -> None:
    raise Rebuilt(options["name"])


@pytest.fixture
def built():
    try:
        return build_cpu_ops()   # builds (and stamps) once where it has not been built
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"the kernels do not build here: {e}")


def test_a_stamped_build_is_imported_without_building(built, monkeypatch):
    monkeypatch.setattr(torch.utils.cpp_extension, "load", refuse_build)
    monkeypatch.delitem(sys.modules, built.__name__, raising=False)   # as a fresh process has it
    again = build_cpu_ops()
    assert again.__file__ == built.__file__
    assert hasattr(again, "rms_norm")


def test_a_changed_header_goes_through_the_build(built, monkeypatch, tmp_path):
    monkeypatch.setattr(torch.utils.cpp_extension, "load", refuse_build)
    changed = shutil.copytree(SOURCE, tmp_path / "cpu")
    (changed / "vec.h").write_text((changed / "vec.h").read_text() + "\n// changed\n")
    with pytest.raises(Rebuilt):
        build_cpu_ops(source=changed)


def test_another_checkouts_sources_build_in_another_folder(tmp_path):
    other = shutil.copytree(SOURCE, tmp_path / "cpu")
    assert default_name(other) != default_name(SOURCE)
    assert default_name(SOURCE) == default_name(SOURCE.parent / SOURCE.name)
