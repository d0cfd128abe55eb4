"""Progress bars of the runtime's long steps (graph captures), on the same switch as transformers' own
(`transformers.utils.logging.disable_progress_bar`: the services' JSON logging turns them all off)."""
from __future__ import annotations

from tqdm import tqdm
from transformers.utils import logging as transformers_logging


def progress(total: int, desc: str, unit: str) -> tqdm:
    return tqdm(total=total, desc=desc, unit=unit, disable=not transformers_logging.is_progress_bar_enabled())
