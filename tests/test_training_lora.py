"""PEFT LoRA on the tiny KimiK3ForCausalLM (trust_remote_code): targets (MLA, KDA, shared/dense MLP, fused experts via
target_parameters), Trainer with checkpointing, save / reload / merge, merged == base + adapter."""

import pytest
import torch

peft = pytest.importorskip("peft")
from peft import PeftModel, get_peft_model  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from kimik3.training import checkpointing_arguments  # noqa: E402
from kimik3.training.lora import default_lora_config, lora_target_modules  # noqa: E402
from training_helpers import (  # noqa: E402
    assert_base_untouched, batch_of, expert_lora_factors, load_tiny, losses, make_trainer, randomize_adapters)


RANK = 4

# what the tiny model (layers 0-2 KDA, 3 MLA; layer 0 dense MLP, 1-3 MoE) must get
EXPECTED_LINEAR_TARGETS = sorted(
    [f"model.layers.{i}.self_attn.{p}" for i in (0, 1, 2) for p in ("q_proj", "k_proj", "v_proj", "g_proj", "o_proj")]
    + [f"model.layers.3.self_attn.{p}" for p in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",
                                                 "g_proj", "o_proj")]
    + [f"model.layers.0.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
    + [f"model.layers.{i}.mlp.shared_experts.{p}" for i in (1, 2, 3) for p in ("gate_proj", "up_proj", "down_proj")]
)



def adapted_names(peft_model):
    prefix = "base_model.model."
    return sorted(
        name[len(prefix):]
        for name, module in peft_model.named_modules()
        if hasattr(module, "lora_A") and type(module).__name__ == "Linear"
    )


def test_default_config_targets():
    model = load_tiny()
    config = default_lora_config(model, r=RANK)
    assert sorted(config.target_modules) == sorted(lora_target_modules(model))
    assert set(config.target_parameters) == {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"}
    assert config.r == RANK and config.lora_alpha == 2 * RANK and config.lora_dropout == 0.0
    peft_model = get_peft_model(model, config)
    assert adapted_names(peft_model) == EXPECTED_LINEAR_TARGETS
    trainable = {n for n, p in peft_model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    # router, KDA decay/beta projections, latent projections, norms, embeddings and lm_head are not adapted
    for left_out in ("mlp.gate.", ".f_a_proj.", ".f_b_proj.", ".b_proj.", "routed_expert_", "lm_head", "embed_tokens"):
        assert not any(left_out in n for n in trainable), left_out
    # every MoE layer's fused experts got a rank-r adapter per expert for both tensors (nested ParamWrappers)
    for i in (1, 2, 3):
        experts = peft_model.base_model.model.model.layers[i].mlp.experts
        wrapped = {experts.parameter_name, experts.base_layer.parameter_name}
        assert wrapped == {"gate_up_proj", "down_proj"}
        assert experts.lora_A["default"].weight.shape[0] == RANK * model.config.num_experts
    no_experts = default_lora_config(load_tiny(), r=RANK, include_experts=False, lora_dropout=0.1)
    assert not no_experts.target_parameters
    with pytest.raises(ValueError, match="dropout"):
        default_lora_config(load_tiny(), r=RANK, lora_dropout=0.1)
    latent = default_lora_config(load_tiny(), r=RANK, include_latent=True)
    assert {"routed_expert_down_proj", "routed_expert_up_proj"} <= set(latent.target_modules)


def test_lora_gradients_reach_every_adapter_including_experts():
    peft_model = get_peft_model(load_tiny(), default_lora_config(load_tiny(), r=RANK))
    randomize_adapters(peft_model)
    peft_model.train()
    peft_model(**batch_of(2)).loss.backward()
    lora = {n: p for n, p in peft_model.named_parameters() if "lora_" in n}
    assert any(".mlp.experts." in n for n in lora)
    for name, p in lora.items():
        assert p.grad is not None and float(p.grad.abs().sum()) > 0, name
    base = [p for n, p in peft_model.named_parameters() if "lora_" not in n]
    assert all(p.grad is None for p in base)


def test_lora_trainer_checkpointing_save_reload_merge(tmp_path):
    base = load_tiny()
    base_state = {k: v.clone() for k, v in base.state_dict().items()}
    peft_model = get_peft_model(base, default_lora_config(base, r=RANK))
    trainer = make_trainer(peft_model, tmp_path / "run", max_steps=12, learning_rate=2e-2, **checkpointing_arguments())
    trainer.train()
    loss = losses(trainer)
    # the adapter learns (slowly: LoRA B starts at zero and lm_head / embeddings are frozen; 4.84 -> 4.53 measured)
    assert sum(loss[-3:]) / 3 < sum(loss[:3]) / 3 - 0.15
    assert peft_model.base_model.model.model.gradient_checkpointing
    assert_base_untouched(peft_model, base_state)  # base weights untouched by training

    batch = batch_of(2, offset=5)
    peft_model.eval()
    with torch.no_grad():
        adapted = peft_model(**batch).logits
        with peft_model.disable_adapter():
            plain = peft_model(**batch).logits
    assert (adapted - plain).abs().max() > 1e-2

    adapter_dir = tmp_path / "adapter"
    peft_model.save_pretrained(adapter_dir)
    saved = load_file(adapter_dir / "adapter_model.safetensors")
    assert any("mlp.experts" in k for k in saved) and any("kv_b_proj" in k for k in saved)
    assert not any("lora_" not in k for k in saved)  # adapter only, no base weights

    reloaded = PeftModel.from_pretrained(load_tiny(), adapter_dir).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**batch).logits, adapted, rtol=0, atol=0)

    # merged model == base + adapter: same function, weights = base + scaling * B @ A
    scaling = reloaded.peft_config["default"].lora_alpha / RANK
    merged = reloaded.merge_and_unload()
    assert type(merged).__name__ == "KimiK3ForCausalLM"
    assert not any("lora_" in n for n, _ in merged.named_parameters())
    with torch.no_grad():
        torch.testing.assert_close(merged(**batch).logits, adapted, rtol=1e-4, atol=2e-5)
    merged_state = merged.state_dict()
    assert merged_state.keys() == base_state.keys()
    num_experts = base.config.num_experts
    changed = set()
    for key, value in merged_state.items():
        if torch.equal(value, base_state[key]):
            continue
        changed.add(key)
        module = key.rsplit(".", 1)[0]
        if key.endswith(".weight"):  # Linear: W + s * B A
            a = saved[f"base_model.model.{module}.lora_A.weight"]
            b = saved[f"base_model.model.{module}.lora_B.weight"]
            torch.testing.assert_close(value, base_state[key] + scaling * b @ a, rtol=1e-5, atol=1e-6)
        else:  # fused experts [E, out, in]: per expert W_e + s * B_e A_e
            a, b = expert_lora_factors(saved, module, value, num_experts, RANK)
            torch.testing.assert_close(value, base_state[key] + scaling * b @ a, rtol=1e-5, atol=1e-6)
            for e in range(num_experts):  # each expert's update has rank <= r
                assert torch.linalg.matrix_rank(value[e] - base_state[key][e], atol=1e-5) <= RANK
    expected = {f"{n}.weight" for n in EXPECTED_LINEAR_TARGETS} | {
        f"model.layers.{i}.mlp.experts.{p}" for i in (1, 2, 3) for p in ("gate_up_proj", "down_proj")
    }
    assert changed == expected
