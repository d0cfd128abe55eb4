"""Tiny random Llama-family models with a real (trained) byte-level BPE tokenizer, saved as HF
directories so the services load them through the same path as any checkpoint."""
from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, PreTrainedTokenizerFast, Qwen2Config

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Speculative decoding: a draft proposes, the target verifies, the output is the same.",
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n",
    "Große Straße, café, naïve, 東京, 北京, こんにちは, 🙂🚀 — unicode text survives.",
    "Numbers 0123456789 and symbols !@#$%^&*()[]{} appear in code and prose alike.",
]


def build_tokenizer(vocab_size: int = 400) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model_dir(
    path: Path,
    tokenizer: PreTrainedTokenizerFast,
    seed: int,
    model_type: str = "llama",
    perturb_from: Path | None = None,
    perturb_scale: float = 0.0,
    num_layers: int = 2,
    max_position_embeddings: int = 256,
) -> Path:
    """Saves a random model (or a perturbed copy of `perturb_from`) plus the tokenizer to `path`."""
    torch.manual_seed(seed)
    if perturb_from is not None:
        model = AutoModelForCausalLM.from_pretrained(perturb_from, dtype=torch.float32)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * perturb_scale * p.std().clamp(min=1e-3))
    else:
        config_cls = {"llama": LlamaConfig, "qwen2": Qwen2Config}[model_type]
        config = config_cls(
            vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_position_embeddings,
            initializer_range=0.1,  # well-separated logits: greedy argmax is robust to float noise
            eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
            pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False,
        )
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def build_reduced_head_draft(path: Path, target: Path, keep_every: int = 2) -> Path:
    """A distilled-draft directory (the export path of `python -m distill`) holding all of the target's
    layers but only every `keep_every`-th row of its LM head: it proposes the target's own token
    wherever that token is one of its rows, and something else where it is not."""
    from distill.export import export_draft
    from engine.subset_head import SubsetLMHead

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(target)
    model.lm_head = SubsetLMHead(model.lm_head.weight, torch.arange(0, model.config.vocab_size, keep_every))
    layers = tuple(range(model.config.num_hidden_layers))
    return export_draft(model, tokenizer, path, str(target), layers, torch.float32, {"test": "reduced head"})
