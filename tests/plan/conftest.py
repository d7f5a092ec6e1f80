"""A profile with known step times and the default model's real tokenizer, and simulated
replicas built from it (in this process, on uvicorn threads, as tests/server's)."""
from __future__ import annotations

from pathlib import Path

import pytest

from ember.config import EngineConfig, ServerConfig
from ember.engine.async_engine import AsyncEngine
from ember.plan.profile import Profile
from ember.plan.replica import SimulatedCore
from ember.plan.stepmodel import StepModel
from ember.router.prompts import load_tokenizer
from ember.server.app import create_app
from tests.server.conftest import TEST_KV_GIB, LiveServer, ThreadedServer

# seconds: prompt forward 4 ms + 0.12 ms a row + keys; decode forward 3 ms + 0.6 ms a row,
# 0.2 ms more a row past 8, 0.2 us a key read
STEP_MODEL = StepModel((4e-3, 1.2e-4, 2e-9, 3e-3, 6e-4, 8e-4, 2e-7), 1e-3)


@pytest.fixture(scope="session")
def smollm_tokenizer(smollm_path: Path):
    return load_tokenizer(str(smollm_path))


def make_profile(smollm_path: Path, tokenizer, step_model: StepModel = STEP_MODEL) -> Profile:
    """The default model's facts (its int8 KV cache's bytes per token) and tokenizer, with
    the given step model in place of a measured one."""
    return Profile(model_path=str(smollm_path), model_name=smollm_path.stem,
                   tokenizer=tokenizer.to_dict(), vocab_size=49152, hidden_size=576,
                   max_model_len=8192, block_size=16, kv_bytes_per_token=11520,
                   kv_cache_dtype="int8", step_model=step_model, cold_start_s=2.0)


@pytest.fixture(scope="session")
def profile(smollm_path: Path, smollm_tokenizer) -> Profile:
    return make_profile(smollm_path, smollm_tokenizer)


class SimulatedServer(LiveServer):
    """`ember serve --simulate` in this process: the real app and AsyncEngine over a
    SimulatedCore."""

    def __init__(self, profile: Profile, engine_options: dict | None = None,
                 **server_options) -> None:
        self.config = ServerConfig(port=0, **server_options)
        options = {"kv_cache_gib": TEST_KV_GIB, **(engine_options or {})}
        self.engine = AsyncEngine(EngineConfig.from_options(model=profile.model_path, **options),
                                  max_waiting=self.config.max_waiting,
                                  core_factory=lambda cfg: SimulatedCore(cfg, profile))
        self.app = create_app(self.engine, self.config)
        self.state = self.app.state.ember
        ThreadedServer.__init__(self, self.app)
        self.wait_ready()
