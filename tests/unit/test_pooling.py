"""Pooling: which method a model folder declares, and the Pooler's sums over chunks (a chunk
computed again replaces its sum). Reference: torch's mean, first and last rows of the whole
prompt's hidden states, normalised."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ember.engine.embed import resolve_pooling, sentence_transformers_pooling
from ember.errors import ConfigError
from ember.request import PoolingParams, Request, SamplingParams
from ember.runner.pooling import Pooler
from ember.scheduler.output import ScheduledRequest, SchedulerOutput


def st_folder(tmp_path: Path, flags: dict[str, bool]) -> Path:
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"}]))
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 8, **flags}))
    return tmp_path


@pytest.mark.parametrize("flag, method", [("pooling_mode_mean_tokens", "mean"),
                                          ("pooling_mode_cls_token", "cls"),
                                          ("pooling_mode_lasttoken", "last")])
def test_the_folder_declares_the_pooling(tmp_path, flag, method):
    folder = st_folder(tmp_path, {flag: True, "pooling_mode_max_tokens": False})
    assert sentence_transformers_pooling(folder) == method
    assert resolve_pooling("auto", folder, encoder=False) == method
    assert resolve_pooling("cls", folder, encoder=False) == "cls"   # --pooling wins


def test_without_a_declaration_decoders_take_the_last_token_and_encoders_cls(tmp_path):
    assert sentence_transformers_pooling(tmp_path) is None
    assert resolve_pooling("auto", tmp_path, encoder=False) == "last"
    assert resolve_pooling("auto", tmp_path, encoder=True) == "cls"
    assert resolve_pooling("auto", None, encoder=False) == "last"


def test_a_pooling_ember_does_not_run_is_a_config_error(tmp_path):
    folder = st_folder(tmp_path, {"pooling_mode_mean_tokens": False,
                                  "pooling_mode_max_tokens": True})
    with pytest.raises(ConfigError, match="--pooling"):
        sentence_transformers_pooling(folder)


def plan_of(request: Request, start: int, num_new: int) -> SchedulerOutput:
    return SchedulerOutput([ScheduledRequest(request, start, num_new, [0], samples=False)])


@pytest.mark.parametrize("method", ["mean", "cls", "last"])
def test_chunks_pool_as_the_whole_prompt_even_when_one_is_computed_again(method):
    torch.manual_seed(0)
    hidden = torch.randn(10, 8)
    request = Request("r", list(range(10)), SamplingParams(), frozenset(), 0,
                      pooling=PoolingParams(method))
    pooler = Pooler()
    assert pooler.pool(plan_of(request, 0, 4), hidden[0:4]) == {}
    assert pooler.pool(plan_of(request, 4, 4), hidden[4:8]) == {}
    assert pooler.pool(plan_of(request, 4, 4), hidden[4:8]) == {}   # a retried step
    vector = pooler.pool(plan_of(request, 8, 2), hidden[8:10])["r"]
    want = {"mean": hidden.mean(0), "cls": hidden[0], "last": hidden[-1]}[method]
    assert torch.allclose(torch.tensor(vector), F.normalize(want, dim=0), atol=1e-6)
    assert not pooler._partial   # nothing left behind


def test_dimensions_cut_before_normalising():
    request = Request("r", [1, 2], SamplingParams(), frozenset(), 0,
                      pooling=PoolingParams("last", dimensions=2))
    hidden = torch.tensor([[0.0, 0.0, 0.0], [3.0, 4.0, 12.0]])
    assert Pooler().pool(plan_of(request, 0, 2), hidden)["r"] == pytest.approx([0.6, 0.8])
