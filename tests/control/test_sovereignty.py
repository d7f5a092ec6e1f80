"""A short seeded run of benchmarks/control_sovereignty.py (real processes: a control plane,
three planes, their fleets): while planes are killed and restarted, the eu-only tenant's
requests are processed only in eu, as every plane's own gateway counters say."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.heavy    # the benchmark's short run; a plane failure keeps eu in eu by default
@pytest.mark.slow     # about 45 s: three planes start, then 14 s of load with kills
def test_an_eu_only_tenant_is_never_processed_on_us1_through_random_kills(smollm_path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "control_sovereignty.py"), "--seed", "3",
         "--duration", "14", "--per-tenant", "2", "--gap", "3", "5", "--down", "2", "4"],
        capture_output=True, text=True, timeout=400,
        env=os.environ | {"PYTHONPATH": str(ROOT)}, check=False)
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout.splitlines()[-1])
    assert result["kills"], "the schedule killed no plane"
    planes = result["planes"]
    assert result["eu_only_on_us1"] == {"answered_200": 0, "reached": 0}
    assert result["keys_refused_on_us1"] == 0      # us-1 holds no acme key: it would refuse
    # the check reads real counters: us-1's saw the other tenant, eu's saw this one
    assert planes["us-1"]["globex"]["reached"] > 0
    assert sum(planes[p]["acme"]["answered_200"] for p in ("eu-1", "eu-2")) > 0
    # a request sent outside eu would come back refused there (401), not as a 503 naming why
    assert set(result["client"]["acme"]["by_status"]) <= {"200", "503"}
    assert result["client"]["acme"]["first_token"] > 0
