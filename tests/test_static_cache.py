"""Static cache: generate(cache_implementation="static") is exact, and its decode step compiles to one graph."""

import torch
from transformers import CompileConfig

from k3_test_utils import cache_of
from kimik3.tiny import build_tiny_model


def _left_padded(prompts):
    width = max(len(p) for p in prompts)
    batch = torch.stack([torch.cat([torch.zeros(width - len(p), dtype=torch.long), p]) for p in prompts])
    mask = torch.stack([torch.cat([torch.zeros(width - len(p)), torch.ones(len(p))]) for p in prompts]).long()
    return batch, mask


def test_static_cache_generate_equals_dynamic_with_left_padding():
    model = build_tiny_model(num_hidden_layers=6, seed=3)
    batch, mask = _left_padded([torch.randint(3, 128, (n,)) for n in (9, 4, 6)])
    dynamic = model.generate(batch, attention_mask=mask, max_new_tokens=8, do_sample=False)
    out = model.generate(batch, attention_mask=mask, max_new_tokens=8, do_sample=False,
                         cache_implementation="static", return_dict_in_generate=True)
    assert torch.equal(out.sequences, dynamic)
    cache = cache_of(out)
    assert cache.is_static and cache.is_compileable and cache.get_seq_length() == 9 + 7
    layer = model.config.mla_layer_indices[0]
    # preallocated and written in place, rounded up to whole 64-token blocks (aligned GEMMs; the tail stays invalid)
    assert cache.max_cache_len == 9 + 7 and cache.layers[layer].latents.shape[1] == cache.key_valid.shape[1] == 64
    assert cache.key_valid[1, :5].sum() == 0 and cache.key_valid[1, 5:16].all() and not cache.key_valid[:, 16:].any()


def test_compiled_static_decode_is_one_graph_and_exact():
    import torch._dynamo
    from torch._dynamo.utils import counters

    model = build_tiny_model(num_hidden_layers=6, seed=3)
    # what the flag claims (transformers' common tests run their static-cache and compile checks on it) is shown here
    assert type(model)._can_compile_fullgraph is True
    batch, mask = _left_padded([torch.randint(3, 128, (n,)) for n in (7, 3)])
    expected = model.generate(batch, attention_mask=mask, max_new_tokens=7, do_sample=False)
    config = CompileConfig(fullgraph=True, backend="eager", mode=None)
    config._compile_all_devices = True  # generate compiles on CUDA by itself; force it on CPU for the test
    torch._dynamo.reset()
    counters.clear()
    compiled = model.generate(batch, attention_mask=mask, max_new_tokens=7, do_sample=False,
                              cache_implementation="static", compile_config=config)
    assert torch.equal(compiled, expected)
    # fullgraph=True: no graph break anywhere in the decode step; one graph serves every step (no recompiles)
    assert counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()


def test_compiled_decode_keeps_the_grouped_gemm_experts(monkeypatch):
    """On CUDA the compiled decode step keeps the grouped-GEMM experts (a fast path made only of torch ops) instead of
    the gathered reference. Its declaration is relaxed to allow CPU tensors (grouped_mm runs there in bf16) to show
    it is traced into the single graph and gives the tokens of the same path run eagerly."""
    import dataclasses

    import torch._dynamo
    from torch._dynamo.utils import counters

    import kimik3.modeling.dispatch_kimi_k3 as dispatch

    kernels = dispatch.installed_kernels()
    assert kernels is not None and kernels.load("moe_experts") is not None
    monkeypatch.setitem(dispatch.FAST_OPS, "moe_experts",
                        dataclasses.replace(dispatch.FAST_OPS["moe_experts"], cuda_only=False))
    graphs = []

    def recording_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    model = build_tiny_model(num_hidden_layers=4, seed=5).to(torch.bfloat16)
    batch, mask = _left_padded([torch.randint(3, 128, (n,)) for n in (6, 4)])
    expected = model.generate(batch, attention_mask=mask, max_new_tokens=5, do_sample=False,
                              cache_implementation="static", disable_compile=True)
    config = CompileConfig(fullgraph=True, backend=recording_backend, mode=None)
    config._compile_all_devices = True
    torch._dynamo.reset()
    counters.clear()
    compiled = model.generate(batch, attention_mask=mask, max_new_tokens=5, do_sample=False,
                              cache_implementation="static", compile_config=config)
    assert torch.equal(compiled, expected)
    assert counters["stats"]["unique_graphs"] == 1 and len(graphs) == 1
    calls = [str(node.target) for node in graphs[0].graph.nodes if node.op == "call_function"]
    num_moe_layers = sum(1 for layer in model.model.layers if hasattr(layer.mlp, "experts"))
    assert sum("grouped_mm" in c for c in calls) == 2 * num_moe_layers  # gate_up and down of every MoE layer
    torch._dynamo.reset()
