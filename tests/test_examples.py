"""The short scripts in examples/ run offline and print what they promise."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.parametrize(
    "script, expected",
    [
        ("loop_depth.py", ["num_loops=8:", "per-row depths [1, 4, 8]:", "logit lens"]),
        ("looped_decoding.py", ["self-speculative: identical=True", "early exit (kl < 0.05), loops per token:"]),
    ],
)
def test_example_runs_offline(script, expected):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    result = subprocess.run([sys.executable, str(EXAMPLES / script)], capture_output=True, text=True, env=env,
                            timeout=600, check=False)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    for text in expected:
        assert text in result.stdout
