"""Limits every model service enforces on the sequences it serves."""
from __future__ import annotations

from specdec.errors import InvalidRequestError

MAX_VERIFY_DRAFT_TOKENS = 64  # a verify's rows; the gateway's --max-num-draft-tokens stays within it


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


def check_verify(num_draft_tokens: int, num_committed: int, max_len: int) -> None:
    """A verify of `num_draft_tokens` commits up to one more token than that: all must fit the sequence."""
    if num_draft_tokens > MAX_VERIFY_DRAFT_TOKENS:
        raise InvalidRequestError(f"a verify takes at most {MAX_VERIFY_DRAFT_TOKENS} draft tokens, got {num_draft_tokens}")
    if num_committed + num_draft_tokens + 1 > max_len:
        raise InvalidRequestError(
            f"a verify of {num_draft_tokens} draft tokens commits up to {num_draft_tokens + 1} tokens, past the "
            f"sequence's limit of {max_len} tokens (prompt + max_new_tokens); {num_committed} are committed")
