"""The Ray executor (ember/distributed/ray_executor.py): a model's ranks 1..N-1 as Ray actors
in a placement group, on a local Ray cluster of two CPUs started for this module (one head
for every test: a Ray start is slow on a small machine), a CPU per rank.

Reference: the same engine in one process (itself tested against transformers), float32 with
unpacked weights: with the ranks on Ray, the greedy tokens equal it and the logits are within
1e-4 at the prefill and every decode step, as with local processes
(test_tensor_parallel.py). A rank actor that is killed ends the engine (EngineDead); a group
the cluster has no room for fails at start, naming the numbers; without Ray, the executor
says how to install it.
"""
from __future__ import annotations

import asyncio
import sys

import pytest

from ember import LLM, EngineConfig, SamplingParams
from ember.engine.async_engine import AsyncEngine, EngineState
from ember.engine.core import EngineCore
from ember.errors import ConfigError, EngineDead
from tests.conftest import save_tiny_model
from tests.reference.test_llama_vs_hf import PROMPTS
from tests.reference.test_pipeline_parallel import CASES, NUM_STEPS, OPTIONS
from tests.reference.test_tensor_parallel import (DEADLINE_S, _generate_with_deadline,
                                                 assert_same_steps)
from tests.waiting import wait_for

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.ray

CLUSTER_CPUS = 2
RAY = dict(OPTIONS, distributed_executor="ray", ray_cpus_per_rank=1)
LAYOUTS = {"T=2": dict(tensor_parallel_size=2), "P=2": dict(pipeline_parallel_size=2)}


@pytest.fixture(scope="module")
def cluster() -> str:
    """A new local Ray cluster (never one already running here); its address."""
    ray.init(address="local", num_cpus=CLUSTER_CPUS, object_store_memory=100 * 2**20,
             include_dashboard=False, log_to_driver=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory, tokenizer_files):
    """Llama with 9 query and 3 KV heads over 3 layers: both splits are uneven."""
    return save_tiny_model(tmp_path_factory.mktemp("ray-llama"), CASES["llama"](),
                           tokenizer_files)


@pytest.mark.parametrize("layout", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_rank_actors_match_one_process_step_by_step(cluster, llama_folder, layout):
    from ember.distributed.ray_executor import RayActors
    one = EngineCore(EngineConfig.from_options(model=str(llama_folder), **OPTIONS))
    split = EngineCore(EngineConfig.from_options(model=str(llama_folder), **layout, **RAY))
    try:
        assert isinstance(split.executor, RayActors) and len(split.executor.workers) == 1
        assert_same_steps(one, split, NUM_STEPS)
    finally:
        split.close()
    wait_for(lambda: ray.available_resources().get("CPU") == CLUSTER_CPUS,
             "the placement group given back")


def test_a_killed_rank_actor_ends_the_engine(cluster, llama_folder):
    llm = LLM(str(llama_folder), tensor_parallel_size=2, **RAY)
    try:
        llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=2))
        executor = llm.engine.executor
        ray.kill(executor.workers[0], no_restart=True)
        ray.wait(executor.runs, timeout=60, fetch_local=False)   # the actor has died
        assert isinstance(_generate_with_deadline(llm), EngineDead)
        with pytest.raises(EngineDead, match="rank 1 .*a Ray actor.* failed: ActorDiedError"):
            llm.engine.check_alive()
    finally:
        llm.close()


def test_an_idle_engine_dies_with_its_rank_actor(cluster, llama_folder):
    """No request needs to run: the idle engine sees the actor gone, and liveness turns
    false."""
    engine = AsyncEngine(EngineConfig.from_options(model=str(llama_folder),
                                                   tensor_parallel_size=2, **RAY))
    engine.start()
    asyncio.run(engine.wait_ready())
    try:
        assert engine.ready
        ray.kill(engine.core.executor.workers[0], no_restart=True)
        engine._thread.join(DEADLINE_S)   # the engine thread ends once it has noticed
        assert engine.state is EngineState.DEAD and not engine.ready
        assert isinstance(engine.error, EngineDead)
    finally:
        engine.shutdown()


def test_a_group_larger_than_the_cluster_fails_at_start_naming_the_numbers(cluster,
                                                                          llama_folder):
    with pytest.raises(ConfigError, match=r"no room for the model's 3 ranks: a placement "
                                          r"group of 3 bundles \(1\+1\+1 = 3 CPUs.*within "
                                          r"1 s, and the cluster has [\d.]+ of 2 CPUs free"):
        EngineCore(EngineConfig.from_options(model=str(llama_folder), tensor_parallel_size=3,
                                             ray_placement_timeout_s=1, **RAY))
    # the group that did not fit is given up, not left waiting to take the CPUs later
    states = {group["state"] for group in ray.util.placement_group_table().values()}
    assert states <= {"REMOVED"}, states


def test_without_ray_the_executor_says_how_to_install_it(monkeypatch, llama_folder):
    monkeypatch.setitem(sys.modules, "ray", None)   # `import ray` fails as if not installed
    for module in ("ember.distributed.ray_cluster", "ember.distributed.ray_executor"):
        monkeypatch.delitem(sys.modules, module, raising=False)
    with pytest.raises(ConfigError, match=r"pip install ray"):
        EngineCore(EngineConfig.from_options(model=str(llama_folder), tensor_parallel_size=2,
                                             **RAY))


def test_route_gives_multi_rank_replicas_ranks_on_its_cluster():
    from ember.router.ray_replicas import ray_rank_args
    base = ["--model", "m.gguf", "--tensor-parallel-size", "2"]
    assert ray_rank_args(base, 2, "10.0.0.1:6379") == \
        [*base, "--distributed-executor", "ray", "--ray-address", "10.0.0.1:6379"]
    assert ray_rank_args(base[:2], 1, "10.0.0.1:6379") == base[:2]   # one rank: no ranks
    local = [*base, "--distributed-executor=mp"]
    assert ray_rank_args(local, 2, "10.0.0.1:6379") == local        # asked for processes
    elsewhere = [*base, "--ray-address", "h:1"]
    assert ray_rank_args(elsewhere, 2, "10.0.0.1:6379") == \
        [*elsewhere, "--distributed-executor", "ray"]


def test_ranks_on_several_nodes_all_reduce_over_gloo():
    """A shared-memory segment is one host's: where Ray spreads the bundles over nodes, the
    ranks all-reduce over gloo (asking for shm there is refused, naming the nodes)."""
    from ember.distributed.ray_executor import spread_all_reduce
    assert spread_all_reduce("auto", ["n1", "n1", "n1"]) == "auto"   # shm where it builds
    assert spread_all_reduce("auto", ["n1", "n2", "n1"]) == "gloo"
    assert spread_all_reduce("gloo", ["n1", "n1"]) == "gloo"
    with pytest.raises(ConfigError, match="Ray placed them on 2 nodes"):
        spread_all_reduce("shm", ["n1", "n2"])
