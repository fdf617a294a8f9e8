"""The CUDA path's kernels and their host code, installed as ``tinyloop_hf.kernels`` (pyproject's package-dir).

A checkout's root on ``sys.path`` (``python -m`` or ``python -m pytest`` run there) also makes this folder importable
as a top-level ``kernels``, which would hide Hugging Face's ``kernels`` package: transformers >= 5.25 requires it and
imports it from ``transformers.modeling_utils``. Imported under that name, this module hands over to that package.
"""

if __name__ == "kernels":
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _elsewhere = [p for p in sys.path if os.path.abspath(p or os.curdir) != _checkout]
    _spec = importlib.machinery.PathFinder.find_spec("kernels", _elsewhere)
    if _spec is not None and _spec.loader is not None:  # none installed (transformers < 5.25): nothing to hide
        _module = importlib.util.module_from_spec(_spec)
        sys.modules["kernels"] = _module  # the import statement returns what sys.modules holds after this file ran
        _spec.loader.exec_module(_module)
