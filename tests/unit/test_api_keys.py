"""The API keys file (`ember serve --api-keys FILE`): its format, its errors, and how it and
--api-key combine. Reference: the format in the --api-keys help."""
from __future__ import annotations

import pytest

from ember import cli
from ember.config import ApiKey, ServerConfig, parse_api_keys
from ember.errors import ConfigError


def test_keys_tenants_and_priorities_are_read():
    text = "# tenants\n\nk1 alice 2\n  k2 alice\nk3\nk#4 bob -1  \n"
    assert parse_api_keys(text) == (ApiKey("k1", "alice", 2), ApiKey("k2", "alice"),
                                    ApiKey("k3", "line5"), ApiKey("k#4", "bob", -1))


@pytest.mark.parametrize("text,words", [
    ("k1 a 1 extra", ["line 1", "4 fields"]),
    ("k1 a\nk2 b high", ["line 2", "'high'", "integer"]),
    ("k1 a\n\nk1 b", ["line 3", "repeats the key of line 1"]),
    ("k1 al/ice", ["line 1", "'al/ice'", "letters"]),
    ("# nothing\n\n", ["holds no key"]),
])
def test_a_malformed_file_is_a_config_error_naming_the_line(text, words):
    with pytest.raises(ConfigError) as e:
        parse_api_keys(text, source="keys.txt")
    for word in words:
        assert word in e.value.message, e.value.message


def test_api_key_beside_a_file_is_the_default_tenant():
    keys = (ApiKey("k1", "alice"),)
    assert ServerConfig(api_key="solo", api_keys=keys).tenant_keys() == \
        keys + (ApiKey("solo", "default"),)
    assert ServerConfig(api_key="solo").tenant_keys() == ()  # no tenants: as before
    with pytest.raises(ConfigError, match="give each key once"):
        ServerConfig(api_key="k1", api_keys=keys)


def test_cli_reads_the_file(tmp_path):
    path = tmp_path / "keys.txt"
    path.write_text("sk-1 team-a 0\nsk-2 team-b\n")
    args = cli.build_parser().parse_args(["serve", "--api-keys", str(path)])
    assert cli.server_config(args).api_keys == (ApiKey("sk-1", "team-a", 0),
                                                ApiKey("sk-2", "team-b"))
    missing = cli.build_parser().parse_args(["serve", "--api-keys", str(tmp_path / "nope")])
    with pytest.raises(ConfigError, match="cannot read the API keys file"):
        cli.server_config(missing)


def test_serve_stops_at_a_bad_file_before_loading_a_model(tmp_path, capsys):
    path = tmp_path / "keys.txt"
    path.write_text("good tenant\nbad tenant not-a-number\n")
    assert cli.main(["serve", "--api-keys", str(path), "--model", "/nonexistent"]) == 2
    err = capsys.readouterr().err
    assert "line 2" in err and "'not-a-number'" in err
