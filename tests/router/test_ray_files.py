"""A replica started as a Ray actor may run on a node without the gateway's files: the
`--api-keys` file travels as text and is written anew where the replica runs, readable only
by its owner, as `ember serve` reads it."""
from __future__ import annotations

import stat
from pathlib import Path

import pytest

from ember.cli import read_api_keys
from ember.config import parse_api_keys
from ember.errors import ConfigError

pytest.importorskip("ray")
from ember.router.ray_replicas import ship_files, write_files  # noqa: E402

KEYS = "sk-acme acme\nsk-globex globex 2\n"


def test_a_keys_file_travels_as_text_and_is_written_where_the_replica_runs(tmp_path):
    (tmp_path / "gateway").mkdir()
    keys = tmp_path / "gateway" / "chat.keys"
    keys.write_text(KEYS)
    for given in (["--api-keys", str(keys)], [f"--api-keys={keys}"]):
        args, files = ship_files(["--simulate", "p.json", *given, "--kv-cache-gib", "0.1"])
        assert args == ["--simulate", "p.json", "--kv-cache-gib", "0.1"]
        assert files == {"--api-keys": KEYS}
    keys.unlink()                          # the replica's node has no such file
    node = tmp_path / "node"
    node.mkdir()
    option, path = write_files(files, str(node))
    assert option == "--api-keys" and Path(path).parent == node
    assert read_api_keys(path) == parse_api_keys(KEYS)
    assert stat.S_IMODE(Path(path).stat().st_mode) == 0o600


def test_without_shipped_options_the_args_are_unchanged_and_a_missing_file_is_an_error(
        tmp_path):
    assert ship_files(["--model", "m.gguf", "--api-key", "k"]) == \
        (["--model", "m.gguf", "--api-key", "k"], {})
    assert write_files({}, str(tmp_path)) == []
    with pytest.raises(ConfigError, match="readable"):
        ship_files(["--api-keys", str(tmp_path / "missing")])
