"""Two processes serving one target model give a prompt the same bits: its prefill's logits and the greedy
decodes after it, so a request gets one answer from any replica (or from one replica before and after a
restart). On the GPU that holds for the target's kernel stages (engine/kernel_stages.py) and not for
torch.compile's (bench/results/gpu_replicas_kernels.json: one of three replicas parted at the prefill); on
CPU the stages are plain PyTorch. The processes run side by side, as replicas on one host start."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
REPLICA = textwrap.dedent("""
    import hashlib, json, sys
    import torch
    from engine.batch import StepInput
    from engine.model_runner import ModelRunner, RuntimeConfig
    from target_service.cli import CUDA_RUNTIME

    cuda = torch.cuda.is_available()
    runner = ModelRunner(RuntimeConfig(  # the target service's defaults
        model=sys.argv[1], device="cuda" if cuda else "cpu", dtype="bfloat16" if cuda else "float32",
        max_model_len=256, kv_cache_tokens=1024, max_batch_size=4, **(CUDA_RUNTIME if cuda else {})))
    kv = runner.kv.new_sequence()
    digests, ids = [], json.loads(sys.argv[2])
    for _ in range(6):  # the prefill, then greedy decodes
        [logits] = runner.forward([StepInput(kv, ids, 1)])
        row = logits[-1].float().cpu()
        digests.append(hashlib.sha256(row.numpy().tobytes()).hexdigest())
        ids = [int(row.argmax())]
    print(json.dumps(digests))
""")


@pytest.mark.slow
def test_two_target_processes_give_a_prompt_the_same_logits_bits(model_dirs, tmp_path):
    prompt = json.dumps(list(range(7, 47)))  # 40 tokens: a prefill chunk of its own graph bucket on the GPU
    replicas = [subprocess.Popen([sys.executable, "-c", REPLICA, str(model_dirs["target"]), prompt], cwd=ROOT,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 env={**os.environ, "PYTHONPATH": str(ROOT),
                                      "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / f"inductor{i}")})
                for i in range(2)]
    outputs = []
    for replica in replicas:
        stdout, stderr = replica.communicate(timeout=300)
        assert replica.returncode == 0, stderr[-3000:]
        outputs.append(json.loads(stdout.strip().splitlines()[-1]))
    assert len(outputs[0]) == 6 and len(set(outputs[0])) > 1  # six steps, not one row six times
    assert outputs[0] == outputs[1]
