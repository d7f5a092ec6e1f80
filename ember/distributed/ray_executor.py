"""Ranks 1..N-1 as Ray actors (`--distributed-executor ray`), on one node or several.

    placement group: one bundle per rank, {"CPU": its cores}, strategy PACK
      bundle 0   this node: rank 0 is this process (the engine's), the bundle holds its
                 cores so that Ray places no other rank on them
      bundle r   RankActor r, on whichever node Ray packs it (the driver's, while it has
                 room; others once it has not)

Every rank then does what a local worker process does (ember/distributed/worker.py): joins
the driver's TCPStore, at this node's address, loads its part, and joins the ranks' gloo
group, listening at its own node's address. The all-reduce is the shared-memory one where
every bundle is on one node (as `auto` finds it), gloo where Ray spread them.

A cluster without room for the group fails the start after ray_placement_timeout_s, with
the numbers; an actor that dies ends the engine as an exited process does (WorkerRanks).
Import this module only for this executor: ray is optional (ray_cluster.py).
"""
from __future__ import annotations

import logging
import weakref
from typing import TYPE_CHECKING, Any

import torch

# first: without ray installed, this import is the ConfigError that says how to install it
from ember.distributed.ray_cluster import connect, forwarded_env, ray
from ember.distributed.executor import BuildRunner, WorkerPayload, WorkerRanks
from ember.distributed.worker import run_worker
from ember.errors import ConfigError

if TYPE_CHECKING:
    from ray.util.placement_group import PlacementGroup

log = logging.getLogger(__name__)

RANK_OF_THIS_NODE = 0.001   # of the node's own resource "node:IP": pins bundle 0 here


class RankActor:
    """One worker rank in a Ray actor (a process of its own on its node)."""

    def run(self, payload: WorkerPayload) -> None:
        """Load the rank's part and serve the driver's steps until it says stop; raises
        where loading or a step fails (the driver sees the call fail)."""
        logging.basicConfig(level=payload.log_level,
                            format=f"rank {payload.rank}: %(levelname)s %(name)s: %(message)s")
        run_worker(payload, ray.util.get_node_ip_address())


class RayActors(WorkerRanks):
    """Ranks 1..N-1 as RankActors in a placement group on the Ray cluster at `address`
    (None: the running one, else a new local one); `num_cpus`: each rank's CPUs."""

    logs = "its log is among Ray's logs on its node (`ray logs`)"

    def __init__(self, num_cpus: list[int], vocab_widths: list[int], timeout_s: float,
                 build: BuildRunner, setup: Any, all_reduce: str = "auto",
                 stage_size: int | None = None, address: str | None = None,
                 placement_timeout_s: float = 60.0) -> None:
        cluster = connect(address)
        host = ray.util.get_node_ip_address()
        group = place_ranks(num_cpus, host, placement_timeout_s, cluster)
        self.workers: list[ray.actor.ActorHandle] = []
        saved_threads = torch.get_num_threads()
        # a driver that fails to start, or is dropped without shutdown(), ends its actors
        # and gives the cluster its CPUs back
        self._release = weakref.finalize(self, _release, self.workers, group, saved_threads)
        self.nodes = bundle_nodes(group)   # Ray node ids, by rank
        addresses = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes()}
        self.node_addresses = [addresses.get(node, node[:8]) for node in self.nodes]
        super().__init__(len(num_cpus), stage_size, vocab_widths, timeout_s,
                         spread_all_reduce(all_reduce, self.nodes), host)
        torch.set_num_threads(num_cpus[0])
        actor = ray.remote(RankActor)
        env = {"env_vars": forwarded_env(ember_on_path=True)}
        for rank in range(1, self.world_size):
            self.workers.append(actor.options(
                num_cpus=num_cpus[rank], max_restarts=0, max_task_retries=0, runtime_env=env,
                scheduling_strategy=in_bundle(group, rank)).remote())
        self.runs = [worker.run.remote(self.payload(rank, (), num_cpus[rank], build, setup))
                     for rank, worker in enumerate(self.workers, start=1)]
        self._ended: dict[int, str] = {}
        log.info("model parallel: %d ranks on the Ray cluster at %s; rank 0 (this process, "
                 "%s) with %d CPUs, %s", self.world_size, cluster, host, num_cpus[0],
                 ", ".join(f"rank {r} (a Ray actor on {self.node_addresses[r]}) with "
                           f"{num_cpus[r]} CPUs" for r in range(1, self.world_size)))

    def _exited(self, rank: int) -> str | None:
        if rank in self._ended:
            return self._ended[rank]
        run = self.runs[rank - 1]
        done, _ = ray.wait([run], timeout=0, fetch_local=False)
        if not done:
            return None
        what = f"rank {rank} (a Ray actor on {self.node_addresses[rank]})"
        try:
            ray.get(run)
            self._ended[rank] = f"{what} ended"
        except ray.exceptions.RayError as e:
            first = str(e).strip().partition("\n")[0]
            self._ended[rank] = f"{what} failed: {type(e).__name__}: {first}"
        return self._ended[rank]

    def _wait_stopped(self, wait_s: float) -> None:
        ray.wait(self.runs, num_returns=len(self.runs), timeout=wait_s, fetch_local=False)


def place_ranks(num_cpus: list[int], host: str, timeout_s: float,
                cluster: str) -> PlacementGroup:
    """A placement group of a bundle per rank, bundle 0 on this node (`host`), ready; a
    ConfigError naming the numbers where the cluster has no room within `timeout_s`."""
    node = f"node:{host}"
    if node not in ray.cluster_resources():
        raise ConfigError(f"this process runs at {host}, which is not a node of the Ray "
                          f"cluster at {cluster}; run it on one of the cluster's nodes (join "
                          f"this machine first: ray start --address {cluster})")
    bundles: list[dict[str, float]] = [{"CPU": float(n)} for n in num_cpus]
    bundles[0][node] = RANK_OF_THIS_NODE
    group = ray.util.placement_group(bundles, strategy="PACK")
    try:
        ray.get(group.ready(), timeout=timeout_s)
        return group
    except ray.exceptions.GetTimeoutError:
        ray.util.remove_placement_group(group)
    free = ray.available_resources().get("CPU", 0.0)
    total = ray.cluster_resources().get("CPU", 0.0)
    raise ConfigError(
        f"the Ray cluster at {cluster} has no room for the model's {len(bundles)} ranks: a "
        f"placement group of {len(bundles)} bundles ({'+'.join(map(str, num_cpus))} = "
        f"{sum(num_cpus)} CPUs, rank 0's on this node, {host}) was not placed within "
        f"{timeout_s:g} s, and the cluster has {free:g} of {total:g} CPUs free; add nodes, "
        "lower --ray-cpus-per-rank or the ranks, or raise --ray-placement-timeout-s")


def in_bundle(group: PlacementGroup, rank: int) -> Any:
    """The scheduling strategy that puts an actor in bundle `rank` of `group`."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    return PlacementGroupSchedulingStrategy(group, rank)


def bundle_nodes(group: PlacementGroup) -> list[str]:
    """The Ray node id (hex) each bundle is on, by rank."""
    nodes = ray.util.placement_group_table(group)["bundles_to_node_id"]
    return [nodes[rank] for rank in range(len(nodes))]


def spread_all_reduce(kind: str, nodes: list[str]) -> str:
    """The all-reduce the ranks use: `kind`, but gloo where they are on several nodes (a
    shared-memory segment is one host's); a ConfigError where `kind` asks for shm there."""
    count = len(set(nodes))
    if count == 1:
        return kind
    if kind == "shm":
        raise ConfigError(f"--all-reduce shm needs every rank on one host, and Ray placed "
                          f"them on {count} nodes; use --all-reduce auto or gloo")
    log.info("tensor parallel: the ranks are on %d Ray nodes: all-reduce over gloo", count)
    return "gloo"


def _release(actors: list, group: PlacementGroup, saved_threads: int) -> None:
    """End the actors and the placement group (unless Ray has shut down first), and give
    this process its torch threads back."""
    if ray.is_initialized():
        for actor in actors:
            ray.kill(actor, no_restart=True)
        ray.util.remove_placement_group(group)
    torch.set_num_threads(saved_threads)
