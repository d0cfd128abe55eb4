"""Nothing that comes over the wire is unpickled or evaluated: the service packages use no pickle,
marshal, eval/exec or remote model code (a static check, so a regression fails CI)."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ["gateway", "specdec", "target_service", "draft_service", "engine"]
UNSAFE = re.compile(r"\bimport pickle\b|\bpickle\.|\bmarshal\.|\bcloudpickle\b|(?<![.\w])eval\(|(?<![.\w])exec\(|"
                    r"trust_remote_code\s*=\s*True|weights_only\s*=\s*False|yaml\.load\(")


def test_service_code_never_unpickles_or_evaluates_input():
    hits = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
            for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))
            if "/v1/" not in str(path)  # generated protobuf stubs
            for n, line in enumerate(path.read_text().splitlines(), 1) if UNSAFE.search(line)]
    assert not hits, "\n".join(hits)
