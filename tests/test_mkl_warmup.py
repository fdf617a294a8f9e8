"""The MKL VML warm-up (tinyloop_hf/mkl_warmup.py): after it, a fresh process's first multi-threaded cos / sin / exp /
sqrt equal the same op's second call. The race it prevents hits ~1 fresh process in 20 per op on torch 2.13 CPU, so
the check spawns processes (each loads the module by path: no transformers import) and sums what they see."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from tinyloop_hf import mkl_warmup

MODULE = Path(mkl_warmup.__file__)
PROBE = f"""
import importlib.util, torch
torch.set_num_threads(2)
spec = importlib.util.spec_from_file_location("mkl_warmup", {str(MODULE)!r})
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
module.warm_up()
x = torch.arange(256, dtype=torch.float32)[None, :, None] * torch.rand(16, generator=torch.Generator().manual_seed(0))
print(sum(int((f(x) != f(x)).sum()) for f in (torch.cos, torch.sin, torch.exp, torch.sqrt, torch.tanh)))
"""


def test_first_calls_in_fresh_processes_match_the_second_after_the_warm_up():
    runs = [subprocess.Popen([sys.executable, "-c", PROBE], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = []
    for _ in range(10):  # 2 processes at a time (oversubscribing 2 cores makes the race likelier), 20 in all
        for run in runs:
            out, _ = run.communicate(timeout=120)
            assert run.returncode == 0
            outputs.append(int(out.strip()))
        runs = [subprocess.Popen([sys.executable, "-c", PROBE], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    for run in runs:
        run.communicate(timeout=120)
    assert outputs == [0] * 20


def test_the_warm_up_runs_every_listed_op_and_the_op_layer_calls_it(monkeypatch):
    called = []
    for name in mkl_warmup.VML_UNARY:
        op = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda x, _op=op, _name=name: called.append((_name, x.dtype)) or _op(x))
    mkl_warmup.warm_up()
    if torch.backends.mkl.is_available():
        assert set(called) == {(n, d) for n in mkl_warmup.VML_UNARY for d in (torch.float32, torch.float64)}
        assert len(called) == 2 * len(mkl_warmup.VML_UNARY)
    source = (MODULE.parent / "ops_tinyloop.py").read_text()
    assert "from .mkl_warmup import warm_up\n\nwarm_up()" in source
