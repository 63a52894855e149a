"""LoRA on MXFP4-packed experts on the GPU (bf16, the fast experts op): an unmerged adapter on the packed experts
runs as the model with the adapter merged into dense experts (kimik3.training.lora.merge_and_unload) does, and every
adapter gets a gradient. CPU counterpart: tests/test_training_lora_packed.py."""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
peft = pytest.importorskip("peft")

from kimik3.tiny import build_tiny_model, packed_mxfp4_copy  # noqa: E402
from kimik3.training.lora import default_lora_config, merge_and_unload  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_unmerged_packed_adapter_equals_its_dense_merge_on_the_gpu(dtype):
    model = packed_mxfp4_copy(build_tiny_model(seed=5)).to("cuda", dtype)
    adapted = peft.get_peft_model(model, default_lora_config(model, r=4))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=g).cuda()
    adapted.train()
    out = adapted(input_ids=ids, labels=ids)
    out.loss.backward()
    for name, p in adapted.named_parameters():
        if "lora_" in name:
            assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
    adapted.eval()
    with torch.no_grad():
        unmerged = adapted(input_ids=ids).logits.float()
        merged = merge_and_unload(adapted)(input_ids=ids).logits.float()
    assert merged.device.type == "cuda"
    # the same dense experts (dequantised + update, rounded once in the model's dtype) through the same op
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert (unmerged - merged).abs().max() <= tolerance * merged.abs().max()
