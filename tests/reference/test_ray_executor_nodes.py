"""The Ray executor across nodes: a local Ray cluster of two nodes of one CPU each (two
raylets on this machine, started for this module), so the placement group's two bundles land
on different nodes. The ranks then all-reduce over gloo (a shared-memory segment is one
host's, and the executor takes each Ray node for a host of its own) and reach the driver's
store at its node's address.

Reference: the same engine in one process, float32 with unpacked weights: the same greedy
tokens and logits within 1e-4 at every step, as on one node (test_ray_executor.py).
"""
from __future__ import annotations

import pytest

from ember import EngineConfig
from ember.engine.core import EngineCore
from tests.conftest import save_tiny_model
from tests.reference.test_pipeline_parallel import CASES, NUM_STEPS, OPTIONS
from tests.reference.test_ray_executor import RAY
from tests.reference.test_tensor_parallel import assert_same_steps

ray = pytest.importorskip("ray")
pytestmark = [pytest.mark.ray, pytest.mark.heavy]   # two raylets: slow to start

NODE = dict(num_cpus=1, object_store_memory=100 * 2**20)


@pytest.fixture(scope="module")
def two_nodes() -> str:
    from ray.cluster_utils import Cluster
    cluster = Cluster(initialize_head=True, head_node_args=dict(NODE, include_dashboard=False))
    cluster.add_node(**NODE)
    ray.init(address=cluster.address, log_to_driver=False)
    yield cluster.address
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory, tokenizer_files):
    return save_tiny_model(tmp_path_factory.mktemp("ray-nodes-llama"), CASES["llama"](),
                           tokenizer_files)


def test_ranks_on_two_nodes_match_one_process_over_gloo(two_nodes, llama_folder):
    one = EngineCore(EngineConfig.from_options(model=str(llama_folder), **OPTIONS))
    split = EngineCore(EngineConfig.from_options(model=str(llama_folder),
                                                 tensor_parallel_size=2, **RAY))
    try:
        assert len(set(split.executor.nodes)) == 2          # one rank on each node
        assert split.executor.all_reduce.kind == split.executor.steps.kind == "gloo"
        assert_same_steps(one, split, NUM_STEPS)
    finally:
        split.close()
