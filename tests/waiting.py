"""Polling until something holds: the one way tests wait for another thread or process."""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(condition: Callable[[], T], what: str = "the condition", timeout_s: float = 60.0,
             every_s: float = 0.05) -> T:
    """Poll `condition` until it returns something true, and return that. The timeout only
    stops a hung test (a generous bound for busy machines); it measures nothing."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        assert time.monotonic() < deadline, f"never {what}"
        time.sleep(every_s)
    return value
