"""engine/pdl.py's switch: SPECDEC_PDL decides where set, else the service's default (the draft's on,
the target's off); on CPU no kernel is launched with PDL, whatever the switch."""
from __future__ import annotations

import pytest
import torch

from engine import pdl


@pytest.mark.parametrize(("env", "default", "expected"), [
    (None, True, True), (None, False, False), ("0", True, False), ("1", False, True),
])
def test_the_environment_overrides_a_services_default(monkeypatch, env, default, expected):
    if env is None:
        monkeypatch.delenv("SPECDEC_PDL", raising=False)
    else:
        monkeypatch.setenv("SPECDEC_PDL", env)
    assert pdl.from_env(default=default) is expected


def test_cpu_kernels_never_launch_with_pdl(monkeypatch):
    monkeypatch.setattr(pdl, "ENABLED", True)
    assert pdl.launch_options(torch.device("cpu")) == {"USE_PDL": False}
