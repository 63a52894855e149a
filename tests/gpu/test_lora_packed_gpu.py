"""LoRA on MXFP4-packed experts on the GPU (the fast experts op): an unmerged adapter on the packed experts runs as
the model with the adapter merged into dense experts (kimik3.training.lora.merge_and_unload) does, and every adapter
gets a gradient. CPU counterpart: tests/test_training_lora_packed.py."""

import copy

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
peft = pytest.importorskip("peft")

from gpu_helpers import rel_err  # noqa: E402
from kimik3.tiny import build_tiny_model, packed_mxfp4_copy  # noqa: E402
from kimik3.training.lora import default_lora_config, merge_and_unload  # noqa: E402


def _unmerged_and_merged(model, check_gradients=False):
    """Logits of `model` with a seeded random default LoRA, unmerged then merged (the same adapter values for any
    model with the same targets)."""
    adapted = peft.get_peft_model(model, default_lora_config(model, r=4))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=g).cuda()
    if check_gradients:
        adapted.train()
        adapted(input_ids=ids, labels=ids).loss.backward()
        for name, p in adapted.named_parameters():
            if "lora_" in name:
                assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
    adapted.eval()
    with torch.no_grad():
        unmerged = adapted(input_ids=ids).logits.float()
        merged = merge_and_unload(adapted)(input_ids=ids).logits.float()
    return unmerged, merged


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_unmerged_packed_adapter_equals_its_dense_merge_on_the_gpu(dtype):
    dense = build_tiny_model(seed=5)
    packed = packed_mxfp4_copy(dense)
    unmerged, merged = _unmerged_and_merged(copy.deepcopy(packed).to("cuda", dtype), check_gradients=True)
    if dtype == torch.float32:
        # the same dense experts (dequantised + update) through the same op: every logit
        assert (unmerged - merged).abs().max() <= 1e-5 * merged.abs().max()
        return
    # bf16: PEFT's unmerged Linear adapters round x A B apart from the base product and the merge rounds W + B A once,
    # so unmerged and merged differ by bf16 rounding (4% of the logits' norm on this tiny model with large random
    # adapters, measured on the CPU, packed and dense alike). The packed experts must add nothing to it: the same
    # comparison on the dense model of the dequantised experts is the baseline.
    decoded = copy.deepcopy(dense)
    with torch.no_grad():
        for name, module in packed.named_modules():
            if type(module).__name__ == "KimiK3Experts":
                for stack in module.STACKS:
                    getattr(decoded.get_submodule(name), stack).copy_(module.dense_stacks(torch.float32)[
                        module.STACKS.index(stack)])
    base_unmerged, base_merged = _unmerged_and_merged(decoded.to("cuda", dtype))
    assert rel_err(unmerged, merged) <= 1.5 * rel_err(base_unmerged, base_merged) + 1e-3
    assert rel_err(unmerged, base_unmerged) <= 2e-2
