"""Helpers of the GPU tests (kernels / reference-op loaders, the reference switch, error metrics)."""

import contextlib
import importlib
import os

import torch


def load_kernels():
    return importlib.import_module("kimik3.kernels")


def load_ops():
    return importlib.import_module("kimik3.modeling.ops_kimi_k3")


def load_dispatch():
    return importlib.import_module("kimik3.modeling.dispatch_kimi_k3")


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


def tiny_prefill_errors_fast_and_reference_kda(monkeypatch, before_fast=None) -> tuple[float, float]:
    """A bf16 tiny model's prefill (4 layers, 2 x 200 tokens, no cache) with every fast path, and with chunk_kda on
    its reference, each as a relative error against the f32 model on the reference ops: (fast, reference KDA).
    `before_fast` runs just before the fast forward (to install a spy)."""
    import copy

    from kimik3.tiny import build_tiny_model

    gold_model = build_tiny_model(num_hidden_layers=4, hidden_size=128, num_heads=4, head_dim=64).cuda()
    assert gold_model.config.gate_lower_bound is not None
    model = copy.deepcopy(gold_model).bfloat16()
    ids = torch.randint(3, 128, (2, 200), device="cuda")
    with torch.no_grad():
        monkeypatch.setenv("KIMIK3_REFERENCE_ONLY", "1")
        gold = gold_model(ids, use_cache=False).logits.float()
        monkeypatch.setenv("KIMIK3_REFERENCE_ONLY", "chunk_kda")
        ref = model(ids, use_cache=False).logits.float()
        monkeypatch.delenv("KIMIK3_REFERENCE_ONLY")
        if before_fast is not None:
            before_fast()
        fast = model(ids, use_cache=False).logits.float()
    return rel_err(fast, gold), rel_err(ref, gold)
