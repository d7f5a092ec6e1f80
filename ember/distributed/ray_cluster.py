"""Joining a Ray cluster, for whatever ember runs on it: a fleet's replicas
(ember/router/ray_replicas.py) and a model's ranks (ember/distributed/ray_executor.py).

Ray is optional: import this module only where Ray is asked for. Without Ray installed, the
import fails with a ConfigError that says how to install it. No torch here: the fleet
imports it.
"""
from __future__ import annotations

import os
from pathlib import Path

import ember
from ember.errors import ConfigError

try:
    import ray
except ImportError as e:
    raise ConfigError("Ray is not installed, and --ray / --distributed-executor ray run on "
                      "it: pip install ray (or pip install 'ember[fleet]')") from e

# what a process on a node needs from this process's environment to run the same ember the
# same way
FORWARDED_ENV = ("PYTHONPATH", "TORCH_EXTENSIONS_DIR", "EMBER_MODEL", "EMBER_API_KEY")


def connect(address: str | None) -> str:
    """Joins the Ray cluster at `address` (None: the one `ray start` set up on this machine,
    else a new local one) once per process; its GCS address, which others can join."""
    if not ray.is_initialized():
        ray.init(address=address, ignore_reinit_error=True, log_to_driver=False)
    return ray.get_runtime_context().gcs_address


def forwarded_env(ember_on_path: bool = False) -> dict[str, str]:
    """FORWARDED_ENV's variables that are set here; with `ember_on_path`, PYTHONPATH begins
    with the folder this process imports ember from (a node imports the same ember where it
    is installed at the same path)."""
    env = {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ}
    if ember_on_path:
        root = str(Path(ember.__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    return env
