"""Evaluation helpers: offline lm-eval tasks (``TASKS_DIR``); benchmarks arrive with the CUDA path."""

from pathlib import Path

TASKS_DIR = Path(__file__).parent / "tasks"

__all__ = ["TASKS_DIR"]
