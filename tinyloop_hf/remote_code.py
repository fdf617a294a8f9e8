"""The ``auto_map`` shims every saved checkpoint carries.

``trust_remote_code=True`` loads these two small files; they import the installed package, so Hub users and
package users run the same code, and a missing package gives one clear instruction instead of a stack trace.
"""

from __future__ import annotations

import os
from pathlib import Path

AUTO_MAP = {
    "AutoConfig": "configuration_tinyloop.TinyLoopConfig",
    "AutoModel": "modeling_tinyloop.TinyLoopModel",
    "AutoModelForCausalLM": "modeling_tinyloop.TinyLoopForCausalLM",
}

_INSTALL_HINT = "This checkpoint runs on the tinyloop-hf package, which is not installed. Install it with: "
_INSTALL_COMMAND = "pip install tinyloop-hf"

_SHIMS = {
    "configuration_tinyloop.py": ("TinyLoopConfig",),
    "modeling_tinyloop.py": ("TinyLoopConfig", "TinyLoopForCausalLM", "TinyLoopModel"),
}


def _shim_source(names: tuple[str, ...]) -> str:
    imported = ", ".join(names)
    return (
        '"""auto_map entry point written by tinyloop-hf: the implementation lives in the installed package."""\n\n'
        "try:\n"
        f"    from tinyloop_hf import {imported}\n"
        "except ImportError as error:  # the package is the implementation; say how to get it\n"
        f"    raise ImportError(\n        {_INSTALL_HINT!r}\n        {_INSTALL_COMMAND!r}\n    ) from error\n\n"
        f"__all__ = {list(names)!r}\n"
    )


def write_remote_code(directory: str | os.PathLike[str]) -> None:
    """Write the shim files named in ``AUTO_MAP`` into ``directory``."""
    for filename, names in _SHIMS.items():
        (Path(directory) / filename).write_text(_shim_source(names))
