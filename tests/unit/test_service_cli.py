"""A model service refuses flags its runtime cannot take as a usage error that says what is wrong."""
from __future__ import annotations

import pytest

from draft_service.cli import main as draft_main
from target_service.cli import main as target_main


@pytest.mark.parametrize(("main", "argv", "message"), [
    (target_main, ["--kv-cache-memory-fraction", "2"], "kv_cache_memory_fraction must be in (0, 1)"),
    (target_main, ["--max-model-len", "1"], "max_model_len must be >= 2"),
    (draft_main, ["--drafter", "model", "--max-batch-size", "0"], "max_batch_size must be >= 1"),
])
def test_a_runtime_setting_out_of_range_exits_with_its_reason(main, argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--device", "cpu", *argv])
    assert exit_info.value.code == 2  # argparse's usage error, before any model loads
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(("main", "argv"), [(target_main, []), (draft_main, ["--drafter", "model"])])
def test_a_model_that_cannot_load_ends_the_service_with_its_reason(main, argv, tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(SystemExit) as exit_info:
        main(["--device", "cpu", *argv, "--model", str(missing)])
    assert f"cannot load model '{missing}': no such file or directory" in str(exit_info.value.code)
    assert str(exit_info.value.code).startswith("specdec-")  # the program's name, then the reason: exit status 1
