"""Triton kernels on CPU tensors, for the CPU tests: `interpreted(module, gpu_tests)`
imports a kernel module under Triton's interpreter."""
from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType

import pytest
import torch


def interpreted(module_name: str, gpu_tests: str) -> ModuleType:
    """module_name imported with TRITON_INTERPRET=1, reloaded if it was imported compiled
    before; the calling test module is skipped where a GPU is present (gpu_tests runs
    the same kernels compiled) or Triton is missing. Call it at module level."""
    if torch.cuda.is_available():
        pytest.skip(f"a GPU is present: {gpu_tests} runs these kernels compiled",
                    allow_module_level=True)
    # NOTE: triton picks interpreter or compiler when a kernel is decorated, so this
    # must precede the module's (re)import.
    os.environ["TRITON_INTERPRET"] = "1"
    pytest.importorskip("triton")
    if module_name in sys.modules:
        return importlib.reload(sys.modules[module_name])
    return importlib.import_module(module_name)
