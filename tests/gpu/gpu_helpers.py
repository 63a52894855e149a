"""Helpers of the GPU tests (kernels / reference-op loaders, error metrics)."""

import importlib

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
