"""bench/mps.py: the run's own MPS daemon, started and told to quit, the environment restored after.

`nvidia-cuda-mps-control` is a driver utility no CI machine has; a stand-in script on PATH records how
it was called (arguments, stdin, the pipe directory it was given), which is all the helper decides."""
from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from harness import bench_module


@pytest.fixture(scope="module")
def mps():
    yield from bench_module("mps")


@pytest.fixture
def control(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A stand-in control binary on PATH; returns the log it appends each call to."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    script = bin_dir / "nvidia-cuda-mps-control"
    script.write_text(f'#!/bin/sh\necho "args=$* pipe=$CUDA_MPS_PIPE_DIRECTORY stdin=$(cat)" >> {log}\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    monkeypatch.setenv("CUDA_MPS_LOG_DIRECTORY", "/elsewhere")
    return log


def test_the_daemon_runs_for_the_block_with_its_own_directories(mps, control: Path, tmp_path: Path):
    work = tmp_path / "run"
    with mps.mps_daemon(work):
        assert os.environ["CUDA_MPS_PIPE_DIRECTORY"] == str(work / "mps-pipe")
        assert os.environ["CUDA_MPS_LOG_DIRECTORY"] == str(work / "mps-log")
        assert (work / "mps-pipe").is_dir()
        started = control.read_text().splitlines()
        assert started == [f"args=-d pipe={work / 'mps-pipe'} stdin="]
    calls = control.read_text().splitlines()
    assert calls[1] == f"args= pipe={work / 'mps-pipe'} stdin=quit"
    assert "CUDA_MPS_PIPE_DIRECTORY" not in os.environ  # restored: what runs after is not an MPS client
    assert os.environ["CUDA_MPS_LOG_DIRECTORY"] == "/elsewhere"


def test_the_daemon_quits_when_the_block_fails(mps, control: Path, tmp_path: Path):
    with pytest.raises(RuntimeError, match="benchmark failed"):
        with mps.mps_daemon(tmp_path / "run"):
            raise RuntimeError("benchmark failed")
    assert control.read_text().splitlines()[-1].endswith("stdin=quit")
    assert "CUDA_MPS_PIPE_DIRECTORY" not in os.environ


def test_without_the_control_binary_the_reason_is_given(mps, monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert "nvidia-cuda-mps-control is not on PATH" in mps.check_available()


def test_a_daemon_for_some_services_only_leaves_this_process_alone(mps, control: Path, tmp_path: Path):
    with mps.mps_daemon(tmp_path / "run", set_environ=False) as client_env:
        assert client_env["CUDA_MPS_PIPE_DIRECTORY"] == str(tmp_path / "run" / "mps-pipe")
        assert "CUDA_MPS_PIPE_DIRECTORY" not in os.environ
    assert control.read_text().splitlines()[0] == f"args=-d pipe={tmp_path / 'run' / 'mps-pipe'} stdin="


def test_services_kept_off_mps_get_a_pipe_directory_no_daemon_listens_on(mps, tmp_path: Path):
    env = mps.no_mps_env(tmp_path)
    assert Path(env["CUDA_MPS_PIPE_DIRECTORY"]).is_dir()
    assert list(Path(env["CUDA_MPS_PIPE_DIRECTORY"]).iterdir()) == []
