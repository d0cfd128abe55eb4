"""`python -m specdec.client` against a real trio: a draft chosen by name, a seeded sampled request."""
from __future__ import annotations

import json

import pytest

from specdec import client


def _run(capsys, port: int, *flags: str) -> tuple[list[int], dict]:
    """The streamed token ids and the final chunk's stats of one client run (--json)."""
    client.main(["Once upon a time", "--address", f"127.0.0.1:{port}", "--max-new-tokens", "12", "--json", *flags])
    chunks = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    return [int(t) for c in chunks for t in c.get("token_ids", [])], chunks[-1]["stats"]


def test_client_cli_picks_a_draft_by_name_and_an_unknown_one_is_not_found(gateways, capsys):
    token_ids, stats = _run(capsys, gateways["identical"], "-k", "3", "--draft-model", "default")
    assert len(token_ids) > 0 and stats["acceptance_rate"] == 1.0  # the identical draft, by its name
    with pytest.raises(SystemExit) as info:
        _run(capsys, gateways["identical"], "--draft-model", "missing")
    assert info.value.code == 1 and "NOT_FOUND" in capsys.readouterr().err


def test_client_cli_sampled_request_repeats_with_its_seed(gateways, capsys):
    flags = ("-k", "2", "--temperature", "0.9", "--seed", "7")
    first, _ = _run(capsys, gateways["perturbed"], *flags)
    again, _ = _run(capsys, gateways["perturbed"], *flags)
    assert first == again and len(first) > 0
