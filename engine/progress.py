"""Progress bars of the runtime's long steps (graph captures), on the same switch as transformers' own
(`transformers.utils.logging.disable_progress_bar`: the services' JSON logging turns them all off).
Otherwise tqdm's defaults hold, TQDM_DISABLE=1 among them."""
from __future__ import annotations

from tqdm import tqdm
from transformers.utils import logging as transformers_logging


def progress(total: int, desc: str, unit: str) -> tqdm:
    off = {} if transformers_logging.is_progress_bar_enabled() else {"disable": True}
    return tqdm(total=total, desc=desc, unit=unit, **off)
