"""A replica tells a router whose fault a 5xx is: the request's own (it failed alone, or ran
past its time limit: sending it elsewhere fails the same way, and the server is fine), or the
server's (it must be taken out of rotation). The reference is ember's error classes."""
from __future__ import annotations

import pytest

from ember.engine.async_engine import RequestTimeout
from ember.errors import EngineDead, EngineLoading, Overloaded, RequestFailed
from ember.server.errors import FAULT_HEADER, error_response


@pytest.mark.parametrize("error, request_fault", [
    (RequestFailed("failed alone"), True),
    (RequestTimeout("past --request-timeout"), True),
    (EngineDead("the engine stopped"), False),
    (EngineLoading("still loading"), False),
    (Overloaded("queue full"), False),
])
def test_a_5xx_says_whether_it_is_the_requests_own_fault(error, request_fault):
    response = error_response(error)
    assert response.status_code == error.http_status
    assert (response.headers.get(FAULT_HEADER) == "request") == request_fault
