"""auto_map entry point written by tinyloop-hf: the implementation lives in the installed package."""

try:
    from tinyloop_hf import TinyLoopConfig
except ImportError as error:  # the package is the implementation; say how to get it
    raise ImportError(
        'This checkpoint runs on the tinyloop-hf package, which is not installed. Install it with: '
        'pip install tinyloop-hf'
    ) from error

__all__ = ['TinyLoopConfig']
