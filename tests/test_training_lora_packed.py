"""PEFT LoRA on routed experts kept MXFP4-packed (a folder of packed experts loaded with trust_remote_code): the same
`target_parameters` as dense experts reach them through adapter points; codes and scales stay frozen; the unmerged
adapter runs as a dense model with the dequantised experts and the same adapter does; train, save, reload, and
`kimik3.training.lora.merge_and_unload` into dense experts that save and load back."""

import functools
import tempfile
from pathlib import Path

import pytest
import torch

peft = pytest.importorskip("peft")
from peft import PeftModel, get_peft_model  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from kimik3.training.lora import default_lora_config, merge_and_unload  # noqa: E402
from training_helpers import (  # noqa: E402
    assert_base_untouched, batch_of, expert_lora_factors, losses, make_trainer, randomize_adapters)


RANK = 4
EXPERT_TENSORS = ("gate_up_proj", "down_proj")


@functools.lru_cache(maxsize=None)
def folders() -> tuple[str, str]:
    """(packed, dense): the same tiny model with its routed experts packed as MXFP4, and with those experts
    dequantised (exact) into dense stacks, each saved with its remote code."""
    from kimik3.modeling import ops_kimi_k3 as ops
    from kimik3.remote_code import save_with_code
    from kimik3.tiny import build_tiny_model, packed_mxfp4_copy

    root = Path(tempfile.mkdtemp(prefix="kimik3-packed-lora-"))
    dense = build_tiny_model(seed=3)
    packed = packed_mxfp4_copy(dense)
    with torch.no_grad():
        for name, module in packed.named_modules():
            if type(module).__name__ == "KimiK3Experts":
                target = dense.get_submodule(name)
                for tensor in EXPERT_TENSORS:
                    codes, scale = getattr(module, f"{tensor}_packed"), getattr(module, f"{tensor}_scale")
                    getattr(target, tensor).copy_(ops.dequantize_mxfp4(codes, scale, torch.float32))
    save_with_code(packed, root / "packed")
    save_with_code(dense, root / "dense")
    return str(root / "packed"), str(root / "dense")


def load(which: str, **kwargs):
    path = folders()[0 if which == "packed" else 1]
    return AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=kwargs.pop("dtype", torch.float32),
                                                **kwargs)


def experts_modules(model):
    return {name: module for name, module in model.named_modules() if type(module).__name__ == "KimiK3Experts"}


def adapted(model, **kwargs):
    """The model with the default LoRA (experts included), its targets read from the model before it is wrapped."""
    return get_peft_model(model, default_lora_config(model, r=RANK), **kwargs)



def test_packed_experts_offer_adapter_points_that_are_no_weights():
    model = load("packed")
    config = default_lora_config(model, r=RANK)
    assert set(config.target_parameters) == {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"}
    text = model.config.get_text_config()
    for name, experts in experts_modules(model).items():
        shapes = {"gate_up_proj": (text.num_experts, 2 * text.moe_intermediate_size, text.latent_size),
                  "down_proj": (text.num_experts, text.latent_size, text.moe_intermediate_size)}
        for point, shape in shapes.items():
            p = getattr(experts, point)
            # the dense stack's name, shape and the model's dtype, on the codes' device, one element of memory
            assert tuple(p.shape) == shape and p.dtype == torch.float32 and not p.requires_grad, name
            assert p.device == experts.gate_up_proj_packed.device and p.untyped_storage().nbytes() == 4
    # not weights: neither saved nor expected by a load
    assert not any(key.endswith(EXPERT_TENSORS) for key in model.state_dict())
    assert model.load_state_dict(model.state_dict(), strict=True)
    # a cast or move offers them again (a tensor cast would be a full-size copy)
    model.to(torch.bfloat16)
    for experts in experts_modules(model).values():
        assert experts.gate_up_proj.dtype == torch.bfloat16 and experts.gate_up_proj.untyped_storage().nbytes() == 2
        assert experts.gate_up_proj_packed.dtype == torch.uint8


def test_unmerged_packed_adapter_equals_the_dense_model_with_the_same_adapter_and_trains_only_adapters():
    packed, dense = (adapted(load(which)) for which in ("packed", "dense"))
    randomize_adapters(packed)
    dense.load_state_dict(packed.state_dict(), strict=False)
    adapters = {n: p for n, p in packed.named_parameters() if "lora_" in n}
    assert any(".mlp.experts." in n for n in adapters)
    for name, p in dense.named_parameters():
        if "lora_" in name:
            assert torch.equal(p, adapters[name]), name
    batch = batch_of(2, offset=3)
    packed.train()
    out = packed(**batch)
    out.loss.backward()
    for name, p in adapters.items():
        assert p.grad is not None and float(p.grad.abs().sum()) > 0, name
    assert all(p.grad is None for n, p in packed.named_parameters() if "lora_" not in n)
    dense.eval(), packed.eval()
    with torch.no_grad():
        want = dense(**batch).logits
        got = packed(**batch).logits
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        with packed.disable_adapter():
            assert (packed(**batch).logits - got).abs().max() > 1e-2  # the expert adapters matter


def test_packed_lora_trains_saves_reloads_and_merges_into_dense_experts(tmp_path):
    base = load("packed")
    frozen = {k: v.clone() for k, v in base.state_dict().items()}
    peft_model = get_peft_model(base, default_lora_config(base, r=RANK))
    trainer = make_trainer(peft_model, tmp_path / "run", max_steps=8, learning_rate=2e-2)
    trainer.train()
    loss = losses(trainer)
    assert sum(loss[-3:]) / 3 < sum(loss[:3]) / 3 - 0.1
    assert_base_untouched(peft_model, frozen)  # codes and scales (and every other base tensor) untouched

    batch = batch_of(2, offset=7)
    peft_model.eval()
    with torch.no_grad():
        adapted = peft_model(**batch).logits
    adapter_dir = tmp_path / "adapter"
    peft_model.save_pretrained(adapter_dir)
    saved = load_file(adapter_dir / "adapter_model.safetensors")
    assert any(".mlp.experts." in k for k in saved) and all("lora_" in k for k in saved)

    reloaded = PeftModel.from_pretrained(load("packed"), adapter_dir).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**batch).logits, adapted, rtol=0, atol=0)
    experts_before = {name.replace(".base_layer", ""): m.dense_stacks(torch.float32)
                      for name, m in experts_modules(reloaded.get_base_model()).items()}
    scaling = reloaded.peft_config["default"].lora_alpha / RANK
    merged = merge_and_unload(reloaded)
    assert type(merged).__name__ == "KimiK3ForCausalLM" and merged.config.experts_format == "dense"
    assert not any("lora_" in n for n, _ in merged.named_parameters())
    with torch.no_grad():
        torch.testing.assert_close(merged(**batch).logits, adapted, rtol=0, atol=1e-5)
    num_experts = merged.config.num_experts
    for name, experts in experts_modules(merged).items():
        assert experts.format.trainable and experts.format.name == "dense"
        for tensor, before in zip(EXPERT_TENSORS, experts_before[name]):
            value = getattr(experts, tensor)
            a, b = expert_lora_factors(saved, name, value, num_experts, RANK)
            torch.testing.assert_close(value, before + scaling * b @ a, rtol=1e-5, atol=1e-6)

    # the dense export saves and loads back as a dense-experts model with the same logits
    merged.save_pretrained(tmp_path / "merged")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", trust_remote_code=True,
                                                 dtype=torch.float32).eval()
    assert again.config.experts_format == "dense"
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in again.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(again(**batch).logits, adapted, rtol=0, atol=1e-5)


def test_packed_lora_in_bf16_keeps_f32_or_bf16_adapters():
    upcast = adapted(load("packed", dtype=torch.bfloat16))  # PEFT's default: adapters in f32
    assert {p.dtype for n, p in upcast.named_parameters() if "lora_" in n} == {torch.float32}
    as_model = adapted(load("packed", dtype=torch.bfloat16), autocast_adapter_dtype=False)
    assert {p.dtype for n, p in as_model.named_parameters() if "lora_" in n} == {torch.bfloat16}
    for peft_model in (upcast, as_model):
        randomize_adapters(peft_model)
        out = peft_model(**batch_of(1))
        assert out.logits.dtype == torch.bfloat16 and torch.isfinite(out.loss)
        out.loss.backward()
        expert_adapters = [p for n, p in peft_model.named_parameters() if "lora_" in n and ".mlp.experts." in n]
        assert expert_adapters and all(p.grad is not None and p.grad.abs().sum() > 0 for p in expert_adapters)


@pytest.mark.parametrize("case", [
    pytest.param("offloaded", id="lora-packed-experts-offloaded"),
    pytest.param("nonfinite", id="lora-packed-merge-nonfinite"),
])
def test_packed_lora_bad_input(case):
    if case == "offloaded":
        # the offload hands the forward only the experts it moved, which the adapter's update does not follow
        model = load("packed", experts_offload="host", experts_cache_bytes=1 << 20)
        peft_model = adapted(model)
        randomize_adapters(peft_model)
        with pytest.raises(NotImplementedError, match="experts kept off the device \\(experts_offload\\)"):
            peft_model(**batch_of(1))
        return
    peft_model = adapted(load("packed"))
    randomize_adapters(peft_model)
    with torch.no_grad():
        next(p for n, p in peft_model.named_parameters() if "layers.2.mlp.experts.lora_B" in n)[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"model\.layers\.2\.mlp\.experts\.\w+: adapter 'default' has a non-finite "
                                         r"update; nothing was merged"):
        merge_and_unload(peft_model, safe_merge=True)
    # nothing merged: the experts still packed and adapted, the config unchanged, the other adapters unmerged
    assert peft_model.get_base_model().config.experts_format == "mxfp4"
    assert all(m.format.name == "mxfp4" for m in experts_modules(peft_model).values())
    assert not any(getattr(m, "merged", False) for m in peft_model.modules())


def test_a_release_loaded_packed_model_merged_saves_the_release_layout_again(tmp_path):
    """Loaded from the release layout with the experts packed, merged into dense experts: save_pretrained writes the
    release layout again (its tensor names), the merged experts quantised back to MXFP4 as a dense load's would be."""
    from safetensors import safe_open

    from kimik3.convert.testing import write_release_checkpoint
    from kimik3.modeling import ops_kimi_k3 as ops
    from kimik3.modeling.modeling_kimi_k3 import KimiK3ForCausalLM

    release = write_release_checkpoint(tmp_path / "release", seed=1, num_layers=2, num_experts=4)
    model = KimiK3ForCausalLM.from_pretrained(release.path, experts_format="mxfp4", dtype=torch.float32)
    peft_model = get_peft_model(model, default_lora_config(model, r=2))
    randomize_adapters(peft_model)
    merged = merge_and_unload(peft_model)
    merged.save_pretrained(tmp_path / "out")

    def names(folder):
        found = set()
        for shard in Path(folder).glob("*.safetensors"):
            with safe_open(shard, "pt") as f:
                found |= set(f.keys())
        return found

    # the text model's tensors, by their release names (the text class holds no vision tower)
    assert names(tmp_path / "out") == {n for n in names(release.path) if n.startswith("language_model.")}
    again = KimiK3ForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    for name, experts in experts_modules(merged).items():
        for tensor in EXPERT_TENSORS:
            requantised = ops.dequantize_mxfp4(*ops.quantize_mxfp4(getattr(experts, tensor)), torch.float32)
            assert torch.equal(getattr(again.get_submodule(name), tensor), requantised), f"{name}.{tensor}"
