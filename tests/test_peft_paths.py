"""An unmerged PEFT LoRA adapter acts on every path, as the merged model does: the full forward (prefill), the cached
decode step (MLA's absorbed form reads `kv_b_proj`'s weight: the adapter's delta is added to it), a static cache and
prompt-lookup verification; and every adapter tensor PEFT adds gets a gradient (the AttnRes pseudo-query projections
are no `nn.Linear`, so "all-linear" does not wrap weights the mix reads without calling them). fp32 on CPU."""

import copy

import pytest
import torch

peft = pytest.importorskip("peft")
from peft import LoraConfig, get_peft_model  # noqa: E402

from kimik3.tiny import build_tiny_model  # noqa: E402
from kimik3.training.lora import default_lora_config  # noqa: E402

LAYERS = 4


def _all_linear_names() -> list[str]:
    model = get_peft_model(build_tiny_model(num_hidden_layers=LAYERS), LoraConfig(target_modules="all-linear", r=2))
    return sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules() if hasattr(module, "lora_A")})


SINGLE_TARGETS = _all_linear_names()


def _adapted(config_of) -> torch.nn.Module:
    model = build_tiny_model(num_hidden_layers=LAYERS, seed=2).float()
    adapted = get_peft_model(model, config_of(model))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # random non-zero adapters (PEFT starts lora_B at zero: a no-op adapter hides nothing)
        for name, tensor in adapted.named_parameters():
            if "lora_" in name:
                tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.2)
    return adapted


CONFIGS = {
    "all-linear": lambda model: LoraConfig(target_modules="all-linear", r=4),
    "default_lora_config": lambda model: default_lora_config(model, r=4),
    **{f"only-{name}": (lambda model, name=name: LoraConfig(target_modules=[name], r=4)) for name in SINGLE_TARGETS},
}


def test_all_linear_wraps_no_weight_the_model_reads_without_calling():
    assert "res_proj" not in " ".join(SINGLE_TARGETS) and "kv_b_proj" in SINGLE_TARGETS
    assert len(SINGLE_TARGETS) >= 10  # the attention, KDA, MLA, MLP and latent-MoE projections


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_an_unmerged_adapter_acts_on_every_path_and_learns(config):
    adapted = _adapted(CONFIGS[config]).eval()
    ids = torch.randint(3, 120, (1, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = adapted(ids).logits
        merged = copy.deepcopy(adapted).merge_and_unload()
        torch.testing.assert_close(merged(ids).logits, full, rtol=0, atol=1e-5)
        prefix = adapted(ids[:, :8], use_cache=True)
        cache = prefix.past_key_values
        for position in range(8, 11):  # three cached decode steps: MLA's absorbed form, KDA's recurrent step
            step = adapted(ids[:, position:position + 1], past_key_values=cache, use_cache=True).logits
            torch.testing.assert_close(step[:, -1], full[:, position], rtol=0, atol=1e-5)
    expected = merged.generate(ids, max_new_tokens=6, do_sample=False)
    for options in ({}, {"use_cache": False}, {"cache_implementation": "static"}, {"prompt_lookup_num_tokens": 3}):
        assert torch.equal(adapted.generate(ids, max_new_tokens=6, do_sample=False, **options), expected), options
    adapted.train()
    adapted(ids, labels=ids).loss.backward()
    silent = [name for name, tensor in adapted.named_parameters()
              if "lora_" in name and (tensor.grad is None or not tensor.grad.abs().sum() > 0)]
    assert not silent, f"adapter tensors without a gradient: {silent[:6]}"
