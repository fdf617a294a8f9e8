"""The small trained looped model that ships inside the package (see embedded_model/README.md)."""

from __future__ import annotations

from pathlib import Path

EMBEDDED_MODEL_DIR = Path(__file__).parent / "embedded_model"


def embedded_model_path() -> Path:
    """Directory of the embedded TinyLoop model: ``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer``
    load it directly (tokenizer included); it also holds calibration and held-out text samples."""
    if not (EMBEDDED_MODEL_DIR / "config.json").exists():
        raise FileNotFoundError(f"the embedded model is missing from this installation ({EMBEDDED_MODEL_DIR})")
    return EMBEDDED_MODEL_DIR
