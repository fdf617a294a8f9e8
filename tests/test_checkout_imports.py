"""Running from a checkout's root puts it on sys.path, where the top-level kernels/ folder could hide Hugging Face's
``kernels`` package (a dependency of transformers >= 5.25, imported by transformers.modeling_utils)."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROBE = """
import sys, kernels
import transformers.modeling_utils  # imports `kernels` where transformers requires it
print(kernels.__file__)
"""


def test_the_kernels_folder_does_not_hide_hugging_face_kernels_from_a_checkout_root():
    result = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    imported = Path(result.stdout.strip().splitlines()[-1]).resolve()
    assert imported.name == "__init__.py"
    try:
        importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:  # transformers < 5.25 without it: our folder, unused
        assert imported == ROOT / "kernels" / "__init__.py"
    else:
        assert imported != ROOT / "kernels" / "__init__.py"  # the installed package, not this checkout's folder
