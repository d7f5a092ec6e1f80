"""A rank's part of a LoRA adapter (ember/distributed/sharding.py's lora_part) against the
reference cut, the base weights' own (TensorShard.take) applied to the adapter's whole
update W = (A B)^T; and how the ranks come to hold the same adapters, step by step
(ember/lora/ranks.py)."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from ember.distributed.parallel import plan_shards, plan_stages
from ember.distributed.sharding import lora_part
from ember.lora.adapter import LoraAdapter, load_adapter, write_random_adapter
from ember.lora.ranks import RankAdapters
from tests.unit.test_tensor_parallel_plan import SMOLLM

SMALL = replace(SMOLLM, hidden_size=48, intermediate_size=96, num_layers=3, head_dim=8,
                vocab_size=64)
PREFIX = "model.layers.0."


@pytest.fixture(scope="module")
def adapter(tmp_path_factory) -> LoraAdapter:
    folder = tmp_path_factory.mktemp("adapter")
    write_random_adapter(folder, SMALL, rank=4, seed=0, std=1.0, alpha=8)
    return load_adapter("a", folder, SMALL, uid=1)


def update(pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The weight update [out, in] of (A [in, R], B [R, out])."""
    a, b = pair
    return (a @ b).t()


@pytest.mark.parametrize("ranks", [2, 4])   # 4: more ranks than KV heads (replicated)
def test_each_ranks_part_is_its_base_weights_cut_of_the_update(adapter, ranks):
    whole = adapter.factors[0]
    q, kv = SMALL.q_size, SMALL.kv_size
    qkv = update(whole["qkv"])
    gate_up = update(whole["gate_up"])
    for shard in plan_shards(SMALL, ranks):
        part = lora_part(shard, None)(adapter).factors[0]
        want_qkv = torch.cat([shard.take(PREFIX + f"self_attn.{p}_proj.weight", w) for p, w in
                              zip("qkv", qkv.split([q, kv, kv]))])
        torch.testing.assert_close(update(part["qkv"]), want_qkv)
        want_gate_up = torch.cat([shard.take(PREFIX + f"mlp.{p}_proj.weight", w)
                                  for p, w in zip(("gate", "up"), gate_up.chunk(2))])
        torch.testing.assert_close(update(part["gate_up"]), want_gate_up)
        for projection, name in (("o", "self_attn.o_proj.weight"),
                                 ("down", "mlp.down_proj.weight")):
            want = shard.take(PREFIX + name, update(whole[projection]))
            torch.testing.assert_close(update(part[projection]), want)
            assert part[projection][1] is whole[projection][1]   # B whole: not copied


def test_a_stage_keeps_its_layers_factors(adapter):
    first, last = plan_stages(SMALL.num_layers, 2)
    staged = lora_part(None, last)(adapter).factors
    assert len(staged) == 1 and all(staged[0][p] is adapter.factors[2][p]
                                    for p in adapter.factors[2])
    shard = plan_shards(SMALL, 2)[1]
    both = lora_part(shard, first)(adapter)
    assert len(both.factors) == 2 and both.width("qkv") == adapter.width("qkv")
    assert lora_part(None, None) is None


def fake(uid: int, digest: str = "sha256:0") -> LoraAdapter:
    return LoraAdapter(f"n{uid}", Path("/x"), uid, digest, 1, [{}])


def test_ranks_take_each_adapter_once_and_forget_it_once_unused():
    driver, worker = RankAdapters(), RankAdapters()
    forgotten: list[int] = []
    worker._on_forget = forgotten.append

    def step(adapters: dict, evicted: list[int]) -> tuple:
        planned, later = driver.plan(adapters, evicted)
        driver.apply(planned)
        worker.apply(planned)
        return planned, later

    a, b = fake(1), fake(2)
    first, _ = step({"a": a, "b": b}, [])
    assert first.uids == {"a": 1, "b": 2} and first.loads == (a, b)
    assert step({"a": a}, [])[0].loads == ()                 # held: nothing travels
    # evicted while a step still uses it: kept until a step does not
    planned, later = step({"a": a}, [1, 2])
    assert planned.forgets == (2,) and later == [1] and forgotten == [2]
    assert step({}, later)[0].forgets == (1,) and len(worker) == len(driver) == 0
    # read again from a changed file under the same uid: taken in again
    step({"a": a}, [])
    changed = fake(1, "sha256:1")
    assert step({"a": changed}, [])[0].loads == (changed,)
    assert worker.get(1) is changed
