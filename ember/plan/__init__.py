"""Capacity planning: `ember plan` and `ember serve --simulate` (docs/plan.md).

Measure a machine's step times once (`measure.py`, the only module here that loads a model),
fit them (`stepmodel.py`), and replay a workload through the engine's own scheduler, KV pool,
prefix cache and the router's policies on a virtual clock (`simulate.py`), to find the
replicas a rate needs within an SLO (`search.py`).
"""
