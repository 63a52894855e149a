# Copyright 2026 The Kimi K3 for transformers authors.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""PEFT LoRA targets for Kimi K3.

:func:`default_lora_config` looks at the model and returns a ``peft.LoraConfig`` with

* attention: MLA ``q_a_proj``, ``q_b_proj`` (or ``q_proj`` without a q LoRA rank), ``kv_a_proj_with_mqa``,
  ``kv_b_proj``, the output gate ``g_proj`` and ``o_proj``; KDA ``q_proj``, ``k_proj``, ``v_proj``, ``g_proj`` (or
  the low-rank ``g_a_proj`` / ``g_b_proj``) and ``o_proj``;
* MLP: ``gate_proj``, ``up_proj``, ``down_proj`` of the dense MLP and of the shared experts;
* optionally the routed experts, whose weights are fused 3-D parameters (``mlp.experts.gate_up_proj [E, 2I, Dl]``,
  ``mlp.experts.down_proj [E, Dl, I]``): LoRA reaches them through ``target_parameters`` (one rank-r adapter per
  expert, peft >= 0.17). Experts kept MXFP4-packed offer the same names and shapes as adapter points (no memory):
  the codes and scales stay frozen, the adapter's update is added to the dequantised experts, and
  :func:`merge_and_unload` merges it into dense experts;
* optionally the latent projections of the routed path (``routed_expert_down_proj`` / ``routed_expert_up_proj``).

Left out on purpose: the router (``mlp.gate``; its bias is set by Quantile Balancing, not by gradients), the KDA
decay and beta projections (``f_a_proj``, ``f_b_proj``, ``b_proj``: tiny, and they drive the state's stability),
the short convolutions, norms, embeddings and ``lm_head``.
"""

from __future__ import annotations

import torch
from torch import nn


ATTENTION_TARGETS = (
    # MLA
    "q_a_proj", "q_b_proj", "q_proj", "kv_a_proj_with_mqa", "kv_b_proj",
    # KDA (q_proj shared with MLA without q LoRA)
    "k_proj", "v_proj", "g_proj", "g_a_proj", "g_b_proj",
    # both
    "o_proj",
)
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
LATENT_TARGETS = ("routed_expert_down_proj", "routed_expert_up_proj")
EXPERT_PARAMETERS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def _intended(name: str, include_latent: bool) -> str | None:
    """The target leaf name if the Linear at ``name`` is one we adapt, else None."""
    parts = name.split(".")
    leaf, parent = parts[-1], parts[-2] if len(parts) > 1 else ""
    if parent == "self_attn" and leaf in ATTENTION_TARGETS:
        return leaf
    grandparent = parts[-3] if len(parts) > 2 else ""
    if leaf in MLP_TARGETS and (parent == "mlp" or (parent == "shared_experts" and grandparent == "mlp")):
        return leaf
    if include_latent and parent == "mlp" and leaf in LATENT_TARGETS:
        return leaf
    return None


def lora_target_modules(model: nn.Module, include_latent: bool = False) -> list[str]:
    """Leaf names of the ``nn.Linear`` modules to adapt, checked so that PEFT's suffix matching of these names hits
    exactly the intended modules and nothing else."""
    linears = {name: module for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    targets = sorted({leaf for name in linears if (leaf := _intended(name, include_latent))})
    for name in linears:
        if _intended(name, include_latent) is None and any(name == t or name.endswith("." + t) for t in targets):
            raise ValueError(f"LoRA target suffixes would also match {name!r}; pass target_modules explicitly")
    return targets


def lora_target_parameters(model: nn.Module) -> list[str]:
    """The fused expert parameters present in the model (dense stacks, or packed experts' adapter points)."""
    names = {name for name, _ in model.named_parameters()}
    return [p for p in EXPERT_PARAMETERS if any(n == p or n.endswith("." + p) for n in names)]


def default_lora_config(
    model: nn.Module,
    r: int = 8,
    lora_alpha: int | None = None,
    include_experts: bool = True,
    include_latent: bool = False,
    **kwargs,
):
    """A ``peft.LoraConfig`` for Kimi K3 (see the module docstring for the targets).

    Args:
        model: the model the adapter is for (its module names decide the targets).
        r: LoRA rank (per expert for the routed experts).
        lora_alpha: scaling numerator (default ``2 * r``).
        include_experts: adapt the routed experts through ``target_parameters``. PEFT's parameter LoRA does not
            support ``lora_dropout``, DoRA or LoRA biases; keep those off when this is on.
        include_latent: also adapt the latent MoE projections.
        **kwargs: passed to ``LoraConfig`` (e.g. ``lora_dropout`` when ``include_experts=False``).
    """
    from peft import LoraConfig

    target_modules = lora_target_modules(model, include_latent=include_latent)
    target_parameters = lora_target_parameters(model) if include_experts else []
    if include_experts and not target_parameters:
        raise ValueError("include_experts=True but the model has no routed experts")
    if target_parameters and kwargs.get("lora_dropout"):
        raise ValueError("lora_dropout is not supported on expert parameters (target_parameters); use 0")
    kwargs.setdefault("task_type", "CAUSAL_LM")
    return LoraConfig(
        r=r,
        lora_alpha=2 * r if lora_alpha is None else lora_alpha,
        target_modules=target_modules,
        target_parameters=target_parameters or None,
        **kwargs,
    )


def merge_and_unload(peft_model, safe_merge: bool = False, adapter_names: list[str] | None = None):
    """PEFT's ``merge_and_unload``, also where the routed experts are kept MXFP4-packed.

    PEFT merges an adapter by adding its update to the parameter in place, which packed experts cannot hold (codes, not
    values). Here every packed experts module becomes a dense one: its experts dequantised (exact) in the adapter
    points' dtype plus the active adapters' updates, as the unmerged adapter ran them; the config's
    ``experts_format`` becomes ``"dense"``. PEFT then merges the rest. Returns the base model, as PEFT does. With dense
    experts this is PEFT's ``merge_and_unload`` alone."""
    from peft.tuners.lora import ParamWrapper

    from kimik3.modeling.release_layout_kimi_k3 import dense_experts_conversions
    from kimik3.modeling.experts_format_kimi_k3 import DENSE, is_experts_module

    model = peft_model.get_base_model()
    dense = {}
    for name, module in model.named_modules():
        experts = module.get_base_layer() if isinstance(module, ParamWrapper) else module
        if name.endswith(".base_layer") or not is_experts_module(experts) or experts.format.trainable:
            continue
        updates, layer = {}, module
        while isinstance(layer, ParamWrapper):
            for adapter in adapter_names or layer.active_adapters:
                if adapter in layer.lora_A:
                    update = layer.get_delta_weight(adapter)
                    if safe_merge and not torch.isfinite(update).all():
                        raise ValueError(f"{name}.{layer.parameter_name}: adapter {adapter!r} has a non-finite "
                                         "update; nothing was merged")
                    updates[layer.parameter_name] = updates.get(layer.parameter_name, 0) + update
            layer = layer.base_layer
        # the dtype the adapter ran in: its points' (the model's floating dtype where a parallel load offered none)
        points = experts._adapter_points()
        dtype = next(iter(points.values())).dtype if points else \
            next(p.dtype for p in model.parameters() if p.is_floating_point())
        stacks = experts.dense_stacks(dtype, [updates.get(stack, torch.zeros((), dtype=dtype))
                                              for stack in experts.STACKS])
        dense[name] = (experts, stacks)
    if dense:
        text_config = model.config.get_text_config()
        for experts, _ in dense.values():
            experts.config.experts_format = DENSE.name
        text_config.experts_format = DENSE.name
        for module in model.modules():
            # a model loaded from the release layout saves it again: its experts quantised back, as a dense load's
            if getattr(module, "_weight_conversions", None):
                module._weight_conversions = dense_experts_conversions(module._weight_conversions)
        for name, (experts, stacks) in dense.items():
            with torch.device("meta"):
                merged = type(experts)(experts.config)
            merged.num_experts = experts.num_experts
            for stack_name, stack in zip(experts.STACKS, stacks):
                setattr(merged, stack_name, nn.Parameter(stack.detach(), requires_grad=False))
            model.set_submodule(name, merged)
    return peft_model.merge_and_unload(safe_merge=safe_merge, adapter_names=adapter_names)


__all__ = ["default_lora_config", "lora_target_modules", "lora_target_parameters", "merge_and_unload"]
