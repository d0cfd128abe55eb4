"""Writes a distilled draft directory: the trained layers (and a reduced head's token ids) plus the file
naming the target they run on."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.model_source import DRAFT_FILE, DRAFT_FORMAT, DRAFT_VOCAB_IDS, DRAFT_WEIGHTS
from engine.subset_head import SubsetLMHead
from engine.tokenizer_info import tokenizer_fingerprint


def export_draft(model, tokenizer, out: Path, target_spec: str, source_layers: tuple[int, ...], dtype: torch.dtype,
                 training: dict) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    state = {name: tensor.detach().to("cpu", dtype).contiguous() for name, tensor in model.state_dict().items()
             if name.startswith("model.layers.")}
    if isinstance(model.lm_head, SubsetLMHead):
        state[DRAFT_VOCAB_IDS] = model.lm_head.vocab_ids.cpu()
    save_file(state, out / DRAFT_WEIGHTS)
    meta = {
        "format": DRAFT_FORMAT,
        "target": target_spec,
        "num_layers": len(source_layers),
        "head_rows": len(model.lm_head.vocab_ids) if isinstance(model.lm_head, SubsetLMHead) else None,
        "source_layers": list(source_layers),
        "target_tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
        "dtype": str(dtype).removeprefix("torch."),
        "training": training,
    }
    (out / DRAFT_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return out
