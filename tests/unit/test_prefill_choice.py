"""`--prefill-matmul auto` (ember/engine/prefill_choice.py): the choice logic on injected
timings (never real ones), and the choice kept beside the weight cache."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from ember.cli import build_parser
from ember.config import ModelConfig
from ember.engine.matmul_timing import Timing, layer_projections
from ember.engine.prefill_choice import (MAX_ERROR, ChoiceStore, PrefillChoice, busy_cpus,
                                         choice_fields, choose_prefill_matmul, pick,
                                         prefill_candidates)
from ember.errors import ConfigError
from ember.weights.cache import CHOICES, prune
from ember.weights.loader import resolve_prefill_matmul

AVX512 = frozenset({"avx512f", "avx512_bf16", "avx512_vnni"})
AMX = AVX512 | {"amx_tile", "amx_bf16", "amx_int8"}
CANDIDATES = ["int8", "bfloat16"]   # the incumbent first, as prefill_candidates lists them


def _config(hidden: int = 576, intermediate: int = 1536) -> ModelConfig:
    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=1000, hidden_size=hidden,
                       intermediate_size=intermediate, num_layers=2, num_heads=9,
                       num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=1e4,
                       max_position_embeddings=2048, tie_word_embeddings=True)


def _fields(flags: frozenset[str] = AVX512, tmp: Path = Path("/nonexistent")) -> dict:
    return choice_fields(flags, 2, tmp / "model.gguf", _config(), "int4", CANDIDATES, None)


def _timing(name: str, *rounds_ms: float, error: float = 0.01) -> Timing:
    rounds = tuple(ms / 1e3 for ms in rounds_ms)
    return Timing(name, sorted(rounds)[len(rounds) // 2], error, rounds)


class _Measure:
    """Injected timings; records which candidates it was asked to time."""

    def __init__(self, *timings: Timing) -> None:
        self.timings, self.calls = timings, []

    def __call__(self, names):
        self.calls.append(list(names))
        return tuple(t for t in self.timings if t.name in names)


def test_the_fastest_candidate_wins_where_it_wins_every_round():
    timings = [_timing("int8", 3.0, 3.1, 2.9), _timing("bfloat16", 1.0, 1.2, 1.1)]
    assert pick(timings, "int8") == ("bfloat16", True)
    timings = [_timing("int8", 1.0, 1.1, 1.0), _timing("bfloat16", 3.0, 2.9, 3.2)]
    assert pick(timings, "int8") == ("int8", True)


def test_a_candidate_outside_the_accuracy_rule_loses_however_fast():
    fast_but_wrong = _timing("bfloat16", 1.0, 1.0, 1.0, error=2 * MAX_ERROR)
    assert pick([_timing("int8", 3.0, 3.0, 3.0), fast_but_wrong], "int8") == ("int8", True)
    wrong_incumbent = _timing("int8", 1.0, 1.0, 1.0, error=2 * MAX_ERROR)
    assert pick([wrong_incumbent, _timing("bfloat16", 3.0, 3.0, 3.0)], "int8") == \
        ("bfloat16", True)


def test_a_noisy_or_close_measurement_keeps_the_incumbent_unsettled():
    # faster by median, but not in every round (one round stalled)
    noisy = [_timing("int8", 3.0, 1.0, 3.0), _timing("bfloat16", 1.0, 3.5, 1.0)]
    assert pick(noisy, "int8") == ("int8", False)
    # faster in every round, but by less than the margin
    close = [_timing("int8", 1.05, 1.05, 1.05), _timing("bfloat16", 1.0, 1.0, 1.0)]
    assert pick(close, "int8") == ("int8", False)


def test_a_measured_choice_is_stored_and_reused_without_timing(tmp_path):
    store = ChoiceStore(tmp_path / CHOICES)
    measure = _Measure(_timing("int8", 3.0, 3.0, 3.0), _timing("bfloat16", 1.0, 1.0, 1.0))
    first = choose_prefill_matmul("auto", CANDIDATES, _fields(), store, measure)
    assert (first.prefill_matmul, first.how) == ("bfloat16", "measured")
    assert measure.calls == [CANDIDATES]
    again = choose_prefill_matmul("auto", CANDIDATES, _fields(), store, measure)
    assert (again.prefill_matmul, again.how) == ("bfloat16", "measured before")
    assert again.timings == first.timings and measure.calls == [CANDIDATES]   # not timed


def test_an_unsettled_choice_is_not_stored(tmp_path):
    store = ChoiceStore(tmp_path / CHOICES)
    measure = _Measure(_timing("int8", 3.0, 1.0, 3.0), _timing("bfloat16", 1.0, 3.5, 1.0))
    for _ in range(2):
        choice = choose_prefill_matmul("auto", CANDIDATES, _fields(), store, measure)
        assert choice.prefill_matmul == "int8" and "unsettled" in choice.how
    assert len(measure.calls) == 2 and store.read(_fields()) is None


def test_an_asked_matmul_skips_measuring(tmp_path):
    measure = _Measure(_timing("int8", 3.0), _timing("bfloat16", 1.0))
    for asked in ("int8", "bfloat16"):
        choice = choose_prefill_matmul(asked, CANDIDATES, _fields(),
                                       ChoiceStore(tmp_path), measure)
        assert (choice.prefill_matmul, choice.how) == (asked, "asked")
    assert measure.calls == [] and not list(tmp_path.iterdir())


def test_a_choice_stored_on_other_cpu_flags_is_not_reused(tmp_path):
    store = ChoiceStore(tmp_path / CHOICES)
    on_amx = _Measure(_timing("int8", 3.0, 3.0), _timing("bfloat16", 1.0, 1.0))
    assert choose_prefill_matmul("auto", CANDIDATES, _fields(AMX), store,
                                 on_amx).prefill_matmul == "bfloat16"
    here = _Measure(_timing("int8", 1.0, 1.0), _timing("bfloat16", 2.0, 2.0))
    choice = choose_prefill_matmul("auto", CANDIDATES, _fields(AVX512), store, here)
    assert (choice.prefill_matmul, choice.how) == ("int8", "measured")
    assert here.calls == [CANDIDATES]
    # each is kept under its own flags
    assert store.read(_fields(AMX)).prefill_matmul == "bfloat16"
    assert store.read(_fields(AVX512)).prefill_matmul == "int8"


def test_without_a_store_or_on_a_busy_machine_the_incumbent_runs_unmeasured(tmp_path):
    measure = _Measure(_timing("int8", 3.0), _timing("bfloat16", 1.0))
    nowhere = choose_prefill_matmul("auto", CANDIDATES, _fields(), None, measure)
    busy = choose_prefill_matmul("auto", CANDIDATES, _fields(), ChoiceStore(tmp_path),
                                 measure, busy="load 3.0 on 2 CPUs")
    assert nowhere.prefill_matmul == busy.prefill_matmul == "int8"
    assert "busy (load 3.0 on 2 CPUs)" in busy.how and measure.calls == []
    alone = choose_prefill_matmul("auto", ["bfloat16"], _fields(), ChoiceStore(tmp_path),
                                  measure)
    assert (alone.prefill_matmul, measure.calls) == ("bfloat16", [])


@pytest.mark.parametrize(("load", "cpus", "threads", "busy"),
                         [(0.4, 2, 2, False), (1.0, 2, 2, False), (1.9, 2, 2, True),
                          (6.5, 16, 8, False), (12.0, 16, 8, True)])
def test_a_machine_is_busy_when_its_load_exceeds_the_cpus_torch_leaves(load, cpus, threads,
                                                                       busy):
    assert (busy_cpus(load, cpus, threads) is not None) == busy


def test_the_description_names_the_choice_and_each_candidates_time():
    timings = (_timing("int8", 1.8, 1.8, 1.8),
               _timing("bfloat16", 1.0, 1.0, 1.0, error=2 * MAX_ERROR))
    text = choose_prefill_matmul("auto", CANDIDATES, _fields(), None,
                                 _Measure()).describe()
    assert text.startswith("int8 (not measured")
    text = PrefillChoice("int8", "measured", timings).describe()
    assert text == ("int8 (measured: int8 1.80 ms, bfloat16 1.00 ms (off by 10.0%) a layer "
                    "at 256 prompt rows)")


def test_big_layers_are_timed_on_fewer_outputs_with_the_models_inputs():
    small = layer_projections(_config())
    assert [(p.in_features, p.out_features) for p in small] == \
        [(576, 960), (576, 576), (576, 3072), (1536, 576)]
    big = layer_projections(_config(hidden=4096, intermediate=14336), max_weights=1 << 24)
    assert [p.in_features for p in big] == [4096, 576, 4096, 14336]
    assert sum(p.in_features * p.out_features for p in big) <= 1 << 24
    assert all(p.out_features % 64 == 0 and p.out_features >= 64 for p in big)


def test_pruning_the_weight_cache_keeps_the_stored_choices(tmp_path):
    ChoiceStore(tmp_path / CHOICES).write(_fields(), choose_prefill_matmul(
        "auto", CANDIDATES, _fields(), None, _Measure()))
    prune(tmp_path, keep=0)
    assert ChoiceStore(tmp_path / CHOICES).read(_fields()) is not None


def test_brgemm_is_a_candidate_only_where_it_runs_the_ukernel():
    amx = SimpleNamespace(has_bf16_dot=True, brgemm_vnni=True)
    avx512 = SimpleNamespace(has_bf16_dot=True, brgemm_vnni=False)
    assert prefill_candidates("int4", amx) == ["int8", "bfloat16", "bfloat16-brgemm"]
    assert prefill_candidates("int4", avx512) == ["int8", "bfloat16"]
    assert prefill_candidates("none", amx) == ["bfloat16"]   # nothing packed: no choice
    assert prefill_candidates("int4", None) == ["bfloat16"]  # the torch path


def test_asking_for_brgemm_runs_it_only_where_its_tile_kernel_does():
    amx = SimpleNamespace(has_bf16_dot=True, brgemm_vnni=True)
    avx512 = SimpleNamespace(has_bf16_dot=True, brgemm_vnni=False)
    assert resolve_prefill_matmul("bfloat16-brgemm", "int4", amx) == "bfloat16-brgemm"
    for method, kernels, why in (("int4", avx512, "AMX"), ("none", amx, "not packed"),
                                 ("int4", None, "compiled kernels")):
        with pytest.raises(ConfigError, match=f"bfloat16-brgemm cannot run: .*{why}"):
            resolve_prefill_matmul("bfloat16-brgemm", method, kernels)
    args = build_parser().parse_args(["serve", "--prefill-matmul", "bfloat16-brgemm"])
    assert args.prefill_matmul == "bfloat16-brgemm"
