"""Helpers of the GPU tests (kernels / reference-op loaders, error metrics)."""

import importlib
import importlib.util
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def _load_by_path(name, path, package_dir=None):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(
        name, path, submodule_search_locations=[str(package_dir)] if package_dir else None
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def load_kernels():
    try:
        return importlib.import_module("kimik3.kernels")
    except ImportError:
        return _load_by_path("kimik3_kernels_local", ROOT / "kernels" / "__init__.py", ROOT / "kernels")


def load_ops():
    try:
        return importlib.import_module("kimik3.modeling.ops_kimi_k3")
    except ImportError:
        return _load_by_path("kimik3_ops_local", ROOT / "modeling_kimik3" / "ops_kimi_k3.py")


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in f64 (0 when both are 0)."""
    a, e = actual.double(), expected.double()
    denom = e.norm().item()
    return (a - e).norm().item() / (denom if denom > 0 else 1.0)


def max_rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|."""
    a, e = actual.double(), expected.double()
    return (a - e).abs().max().item() / max(e.abs().max().item(), 1e-30)
