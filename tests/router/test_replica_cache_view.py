"""What the gateway knows of a replica's prefix cache: the whole of it, from a snapshot on
first contact and after a gap in the replica's event log, and in block keys only for a model
whose tokenizer the gateway has; a replica of another model is routed on the text sent to it.
The reference is the replica alone: its own token ids (/tokenize) under ember's chained block
key, and its own count of cached blocks."""
from __future__ import annotations

import asyncio
import logging

import aiohttp
import httpx
import pytest

from ember.cli import build_parser
from ember.errors import ConfigError
from ember.kv.prefix_cache import extend_keys
from ember.router.cli import serve_argv
from ember.router.config import PrefixConfig, RouterConfig
from ember.router.fleet import Fleet
from ember.router.main import route_tokenizer
from ember.router.replicas import RemoteHandle, Replica
from ember.server.protocol import CompletionRequest
from tests.conftest import save_tiny_model, tiny_hf_model
from tests.router.conftest import LiveGateway
from tests.server.conftest import LiveServer
from tests.waiting import wait_for

TINY = {"max_model_len": 512, "kernels": "torch"}
WINDOW = 4            # KV events the small-window replica keeps
BLOCK = 16


@pytest.fixture(scope="module")
def small_window(tiny_llama_dir):
    """A replica whose event log keeps only the last WINDOW events."""
    folder, _ = tiny_llama_dir
    live = LiveServer(folder, engine_options=TINY | {"max_kv_events": WINDOW})
    yield live
    live.close()


@pytest.fixture(scope="module")
def wordpiece_dir(tmp_path_factory, minilm_path):
    """A tiny random Llama with MiniLM's WordPiece tokenizer: a model other than the default,
    whose token ids for a text are not SmolLM2's."""
    model = tiny_hf_model("llama", vocab_size=30522, tie_word_embeddings=False,
                          bos_token_id=101, eos_token_id=102)
    return save_tiny_model(tmp_path_factory.mktemp("wordpiece_llama"), model, minilm_path)


@pytest.fixture(scope="module")
def wordpiece(wordpiece_dir):
    live = LiveServer(wordpiece_dir, engine_options=TINY)
    yield live
    live.close()



def replica_keys(live: LiveServer, prompt: str) -> list[int]:
    """The block keys the replica gives `prompt`'s full blocks."""
    ids = httpx.post(live.url + "/tokenize", json={"prompt": prompt}).json()["tokens"]
    return extend_keys([], ids, BLOCK)


def complete(url: str, prompt: str) -> None:
    answer = httpx.post(url + "/v1/completions", timeout=60, json={
        "prompt": prompt, "max_tokens": 1, "temperature": 0})
    assert answer.status_code == 200, answer.text


def long_prompt(topic: str) -> str:
    return f"The notes of {topic}, written out at length for the cache. " * 12


def assert_prefix_hit_on_r2(gw: LiveGateway, prompt: str) -> None:
    """A question after `prompt`, sent through the gateway, is routed to r2 for its prefix."""
    complete(gw.url, prompt + " And a question?")
    assert gw.metric('ember_router_routing_decisions_total{reason="prefix_hit",'
                     'replica="r2"}') == 1


def test_a_replica_holding_more_blocks_than_its_event_log_is_known_whole_at_first_contact(
        small_window, replicas, tiny_llama_dir):
    """The replica cached a prompt of many more blocks than its log keeps, before the gateway
    started: its first blocks' events are gone, yet the gateway knows them all and routes a
    request with that prefix (never routed by it) there."""
    folder, _ = tiny_llama_dir
    prompt = long_prompt("first contact")
    keys = replica_keys(small_window, prompt)[:-1]   # the last may change with what follows
    assert len(keys) > 2 * WINDOW
    complete(small_window.url, prompt)
    assert httpx.get(small_window.url + "/kv/events").json()["dropped"] is True
    gw = LiveGateway({"r1": replicas[0].url, "r2": small_window.url}, model=str(folder))
    try:
        gw.wait_ready()
        wait_for(lambda: set(keys) <= gw.fleet.blocks["r2"].blocks,
                 "learned every block of the prompt")
        assert_prefix_hit_on_r2(gw, prompt)
    finally:
        gw.close()


def test_a_gap_in_the_event_log_is_filled_by_a_new_snapshot(small_window):
    """After more events than the log keeps happened between two polls, the next poll
    finds the gap ("dropped") and takes a snapshot: the blocks stored in the gap are known."""
    before = long_prompt("before the gap")
    complete(small_window.url, before)
    fleet = Fleet(RouterConfig(), {})
    replica = fleet.add(Replica("r1", RemoteHandle(small_window.url)))
    fleet.mark_ready(replica)
    index = fleet.blocks["r1"]
    pool = small_window.scheduler.kv.pool

    async def scenario() -> None:
        fleet.session = aiohttp.ClientSession()
        try:
            await fleet.poll_events()
            assert set(replica_keys(small_window, before)) <= index.blocks
            assert len(index.blocks) == pool.num_cached_blocks
            cursor = index.cursor
            during = long_prompt("the gap itself")
            await asyncio.to_thread(complete, small_window.url, during)
            gap = httpx.get(small_window.url + "/kv/events", params={"after": cursor}).json()
            assert gap["dropped"] is True
            await fleet.poll_events()
            assert set(replica_keys(small_window, during)) <= index.blocks
            assert len(index.blocks) == pool.num_cached_blocks
            assert index.resyncs == 1 and index.synced and index.cursor > cursor
        finally:
            await fleet.session.close()
    asyncio.run(scenario())


def test_the_tokenizer_option_hashes_as_a_replica_of_another_model_does(
        wordpiece, wordpiece_dir, replicas):
    """`ember route --replica-url URL --tokenizer PATH`: the gateway's keys are those of the
    replica's own tokenizer, so a prefix it cached before the gateway started is found."""
    tokens = ["--replica-url", wordpiece.url, "--tokenizer", str(wordpiece_dir)]
    args = build_parser().parse_args(["route", *tokens])
    assert serve_argv(tokens, args.route_only) == []      # the gateway's own option
    prompt = long_prompt("another vocabulary")
    keys = replica_keys(wordpiece, prompt)
    default, _ = route_tokenizer(None, None, None)
    if default is not None:   # the premise: the default model's tokenizer hashes otherwise
        assert extend_keys([], default.encode(prompt), BLOCK) != keys
    complete(wordpiece.url, prompt)
    gw = LiveGateway({"r1": replicas[0].url, "r2": wordpiece.url}, model=args.model,
                     tokenizer=args.tokenizer)
    try:
        gw.wait_ready()
        routed = gw.gateway.prompts.route_keys(CompletionRequest(prompt=prompt), None,
                                               {BLOCK}, {}, True).block_keys[BLOCK]
        assert routed == keys
        wait_for(lambda: set(keys[:-1]) <= gw.fleet.blocks["r2"].blocks,
                 "learned the replica's blocks")
        assert_prefix_hit_on_r2(gw, prompt)
    finally:
        gw.close()


def test_a_tokenizer_path_that_is_not_there_stops_the_start(tmp_path):
    with pytest.raises(ConfigError, match="--tokenizer"):
        route_tokenizer(None, str(tmp_path / "missing.gguf"), None)


def test_a_replica_of_a_model_the_gateway_cannot_hash_for_is_routed_on_text(wordpiece,
                                                                           caplog):
    """`ember route --replica-url URL` alone hashes with the default model's tokenizer; a
    replica serving another model is then routed on the text sent to it, which keeps a
    prefix's requests together after the routed blocks expire, and the log says why, once."""
    gw = LiveGateway({"r1": wordpiece.url}, default_tokenizer=True,
                     prefix=PrefixConfig(routed_ttl_s=0.05))
    index = gw.fleet.blocks["r1"]
    hits = 'ember_router_routing_decisions_total{reason="prefix_hit",replica="r1"}'
    prompt = long_prompt("text routing")
    try:
        with caplog.at_level(logging.WARNING, logger="ember.router.fleet"):
            gw.wait_ready()
            wait_for(lambda: index.synced, "polled the replica")
            complete(gw.url, prompt)
            wait_for(lambda: not index.routed, "forgot the routed blocks")
            complete(gw.url, prompt + " Again?")
            assert gw.metric(hits) == 1
            seen = index.cursor
            complete(gw.url, long_prompt("one more"))
            wait_for(lambda: index.cursor > seen, "polled after another request")
        said = [r.getMessage() for r in caplog.records if "routed on the text" in
                r.getMessage()]
        assert len(said) == 1, said
        assert repr(wordpiece.state.model_name) in said[0] and "--tokenizer" in said[0]
    finally:
        gw.close()
