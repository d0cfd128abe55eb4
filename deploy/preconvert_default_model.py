"""Image build step: convert the embedded default model (a GGUF file) into the safetensors cache
under $SPECDEC_CACHE_DIR once, so containers load it in seconds instead of converting at start."""
from __future__ import annotations

from engine.model_source import DEFAULT_MODEL, converted_gguf_dir, default_cache_dir, resolve_path


def main() -> None:
    path = resolve_path(DEFAULT_MODEL)
    assert path is not None and path.suffix == ".gguf", f"{DEFAULT_MODEL} is not a packaged GGUF file"
    print(f"converted {DEFAULT_MODEL} into {converted_gguf_dir(path, default_cache_dir())}")


if __name__ == "__main__":
    main()
