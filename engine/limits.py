"""Limits every model service enforces on the sequences it serves."""
from __future__ import annotations

from specdec.errors import InvalidRequestError


def check_new_sequence(prompt_ids: list[int], max_new_tokens: int, max_model_len: int) -> None:
    """The limits every model service enforces when a sequence opens."""
    if not prompt_ids:
        raise InvalidRequestError("prompt_ids is empty; send at least one token")
    if max_new_tokens < 1:
        raise InvalidRequestError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if len(prompt_ids) + max_new_tokens > max_model_len:
        raise InvalidRequestError(
            f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
            f"model's context of {max_model_len} tokens"
        )
