"""Helpers of the GPU tests (kernels / reference-op loaders, the reference switch, error metrics)."""

import contextlib
import importlib
import os

import torch


def load_kernels():
    return importlib.import_module("kimik3.kernels")


def load_ops():
    return importlib.import_module("kimik3.modeling.ops_kimi_k3")


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in f64 (0 when both are 0)."""
    a, e = actual.double(), expected.double()
    denom = e.norm().item()
    return (a - e).norm().item() / (denom if denom > 0 else 1.0)


def max_rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|."""
    a, e = actual.double(), expected.double()
    return (a - e).abs().max().item() / max(e.abs().max().item(), 1e-30)


def load_fast(name: str):
    """The fast twin `kimik3.kernels` loads for op `name` (asserting it is there, with the reason if not)."""
    kernels = load_kernels()
    fast = kernels.load(name)
    assert fast is not None, f"{name}: {kernels.available_ops()[name]}"
    return fast


@contextlib.contextmanager
def reference_only():
    """Every op runs its pure-PyTorch reference inside the block (the one switch, KIMIK3_REFERENCE_ONLY)."""
    previous = os.environ.get("KIMIK3_REFERENCE_ONLY")
    os.environ["KIMIK3_REFERENCE_ONLY"] = "1"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("KIMIK3_REFERENCE_ONLY")
        else:
            os.environ["KIMIK3_REFERENCE_ONLY"] = previous
