"""Which planes may serve one request, best first: the global endpoint's whole decision.

A plane qualifies only if it is up, serves the request's model, and lies in one of the
tenant's regions; no fallback ever widens that set, so a tenant is never served outside its
regions, even when every plane it may use is down (the caller answers 503 with `why`).
Among those: the client's region (`x-ember-region`) first, then the less loaded plane.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PlaneView:
    name: str
    region: str
    up: bool
    models: frozenset[str]     # the models its fleets serve now (ready)
    in_flight: int             # requests the global endpoint has on it


def candidates(planes: list[PlaneView], model: str, regions: tuple[str, ...],
               client_region: str | None) -> tuple[list[PlaneView], str]:
    """(planes to try in order, why the list is empty: '' when it is not)."""
    allowed = [p for p in planes if not regions or p.region in regions]
    serving = [p for p in allowed if model in p.models]
    up = [p for p in serving if p.up]
    if not up:
        where = f"in regions {', '.join(regions)}" if regions else "in any region"
        what = ("no plane" if not allowed else
                f"no plane serving model {model!r}" if not serving else
                f"every plane serving model {model!r} ({', '.join(p.name for p in serving)}) "
                "is down")
        return [], f"{what} {where}, which this tenant's requests may use; retry later"
    up.sort(key=lambda p: (p.region != client_region, p.in_flight, p.name))
    return up, ""
