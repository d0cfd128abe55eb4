"""The runtime's progress bars: shown by default, off under TQDM_DISABLE=1 and where transformers' are off
(the services' JSON logging)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = """
import sys
from transformers.utils import logging
from engine.progress import progress
if sys.argv[1] == "transformers_off":
    logging.disable_progress_bar()
with progress(2, "capturing", "graph") as bar:
    bar.update(2)
"""


@pytest.mark.parametrize(("setting", "shown"), [("default", True), ("tqdm_disable", False), ("transformers_off", False)])
def test_a_capture_progress_bar_follows_tqdm_disable_and_transformers_switch(setting, shown):
    env = {**os.environ, "TQDM_DISABLE": "1"} if setting == "tqdm_disable" else {
        k: v for k, v in os.environ.items() if k != "TQDM_DISABLE"}
    result = subprocess.run([sys.executable, "-c", SCRIPT, setting], env=env, capture_output=True, text=True,
                            timeout=120, check=True)
    assert ("capturing" in result.stderr) == shown, result.stderr
