"""The request mixes `ember plan profile` sends to the engine it measures, over HTTP, from a
process of their own (as a load generator on the same machine sends them).

    python -m ember.plan.mixes --url http://127.0.0.1:PORT --vocab 49152 --max-seconds 90

The mixes spread the step shapes the step model needs (stepmodel.py): lone prompts of many
lengths at contexts from 0 (a cached prefix gives a prompt its context without computing it),
chunked long prompts, several prompts in one step, decode batches from 1 to 64 at short and
long contexts, and decodes beside a prompt chunk. Prompts are random token ids, so no two
share a prefix by chance. Every request streams, as a served one does.
"""
from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp


@dataclass(frozen=True)
class Mix:
    """Requests sent together (and `late` ones once the first has streamed `late_after`
    tokens)."""

    name: str
    prompt_lens: tuple[int, ...]
    max_tokens: int
    cached_prefix: int = 0           # tokens every prompt shares, cached before the mix runs
    late_prompt_lens: tuple[int, ...] = ()
    late_after: int = 0


WARM_UP = Mix("warm-up", (64, 600), 4)


def mixes() -> list[Mix]:
    """The series, most informative first (a time budget may cut its tail)."""
    out = [Mix(f"decode b{b} c64", (64,) * b, 12) for b in (1, 4, 8, 16, 32)]
    out += [Mix(f"prompt n{n} c{c}", (c + n,), 1, cached_prefix=c)
            for c in (0, 512, 1536) for n in (16, 64, 128, 256, 512)]
    out += [Mix(f"decode b{b} c512", (512,) * b, 12) for b in (1, 8, 24)]
    out += [Mix(f"mixed b{b}", (128,) * b, 24, late_prompt_lens=(700,), late_after=3)
            for b in (1, 4, 16)]
    out += [Mix("prompts 4x96", (96,) * 4, 1), Mix("prompt 1500", (1500,), 1)]
    out += [Mix(f"decode b{b} c256", (256,) * b, 12) for b in (2, 12, 48, 64)]
    out += [Mix(f"decode b{b} c1024", (1024,) * b, 12) for b in (4, 16)]
    return out


class Driver:
    """Sends mixes to one server, a mix at a time."""

    def __init__(self, session: aiohttp.ClientSession, url: str, vocab: int, seed: int) -> None:
        self.session, self.url, self.vocab = session, url.rstrip("/"), vocab
        self.rng = random.Random(seed)

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(1000, self.vocab) for _ in range(max(0, n))]

    async def stream(self, prompt_ids: list[int], max_tokens: int,
                     on_token: Callable[[], None] | None = None) -> None:
        body = {"prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}
        async with self.session.post(self.url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                raise RuntimeError(f"the server answered {resp.status}: "
                                   f"{(await resp.text())[:300]}")
            async for line in resp.content:
                if line.startswith(b"data: {") and on_token is not None:
                    on_token()

    async def run(self, mix: Mix) -> None:
        prefix = self.tokens(mix.cached_prefix)
        if prefix:   # one request computes the prefix's blocks; the mix then finds them
            await self.stream(prefix + self.tokens(1), 1)
        streamed, late = 0, asyncio.Event()

        def count() -> None:
            nonlocal streamed
            streamed += 1
            if streamed >= mix.late_after:
                late.set()

        async def late_prompts() -> None:
            await late.wait()
            await asyncio.gather(*(self.stream(self.tokens(n), 1)
                                   for n in mix.late_prompt_lens))
        work = [self.stream(prefix + self.tokens(n - len(prefix)), mix.max_tokens,
                            count if i == 0 else None) for i, n in enumerate(mix.prompt_lens)]
        if mix.late_prompt_lens:
            work.append(late_prompts())
        await asyncio.gather(*work)


async def drive(url: str, vocab: int, series: list[Mix], max_seconds: float,
                seed: int = 0, say: Callable[[str], None] = print) -> None:
    """Each mix of `series` in turn, until `max_seconds` have passed."""
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        driver = Driver(session, url, vocab, seed)
        began = time.monotonic()
        for mix in series:
            if time.monotonic() - began > max_seconds:
                say(f"time budget spent; skipped {mix.name} and the mixes after it")
                return
            await driver.run(mix)
            say(mix.name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ember.plan.mixes")
    parser.add_argument("--url", required=True)
    parser.add_argument("--vocab", type=int, required=True)
    parser.add_argument("--max-seconds", type=float, default=90.0)
    parser.add_argument("--warm-up", action="store_true", help="send only the warm-up mix")
    args = parser.parse_args(argv)
    series = [WARM_UP] if args.warm_up else mixes()
    asyncio.run(drive(args.url, args.vocab, series, args.max_seconds,
                      say=lambda line: print(line, flush=True)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
