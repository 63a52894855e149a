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
"""FSDP2 (`torch.distributed.fsdp.fully_shard`) for Kimi K3, by hand or through Trainer / accelerate.

K3 keeps f32 islands next to bf16 weights (docs/architecture.md, dtype islands: `A_log`, `dt_bias`, the short-conv
weights, `o_norm`), and one FSDP2 parameter group all-gathers and reduce-scatters a single dtype. So a decoder layer is
sharded as one group per dtype region: the KDA attention (its f32 `A_log`, `dt_bias`, convs and `o_norm`) is an f32
group, its bf16 projections one group each, the rest of the layer one bf16 group. No mixed-precision policy casts the
parameters, since that would round the f32 islands. The router bias `e_score_correction_bias` is a buffer:
FSDP leaves it whole on every rank, and Quantile Balancing (`kimik3.training.QuantileBalancer`) all-reduces its
histograms over the data-parallel ranks before each update, so every rank writes the same bias.

* :func:`shard_model` - gradient checkpointing (optional), then `fully_shard` per decoder layer and on the root.
* :func:`trainer_fsdp_args` - the `TrainingArguments` keyword arguments for the same through Trainer (accelerate's
  FSDP2 plugin).
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn

from .checkpointing import enable_checkpointing


DECODER_LAYER_CLASS = "KimiK3DecoderLayer"


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """Every `KimiK3DecoderLayer` of the model (matched by class name, so remote-code copies count), in order."""
    layers = [module for module in model.modules() if type(module).__name__ == DECODER_LAYER_CLASS]
    if not layers:
        raise ValueError(f"no {DECODER_LAYER_CLASS} in {type(model).__name__}: not a Kimi K3 model")
    return layers


def _main_dtype(module: nn.Module) -> torch.dtype | None:
    counts = Counter()
    for param in module.parameters():
        counts[param.dtype] += param.numel()
    return counts.most_common(1)[0][0] if counts else None


def _subtree_dtypes(module: nn.Module) -> set[torch.dtype]:
    """Dtypes of the parameters under `module` that no nested FSDP group holds yet."""
    from torch.distributed.fsdp import FSDPModule

    dtypes = {p.dtype for p in module.parameters(recurse=False)}
    for child in module.children():
        if not isinstance(child, FSDPModule):
            dtypes |= _subtree_dtypes(child)
    return dtypes


def _shard_dtype_groups(module: nn.Module, main: torch.dtype, fully_shard, **kwargs) -> list[str]:
    """Shard subtrees of `module` so that what is left unsharded under it is all of dtype `main`, every group
    holding one dtype. A child whose own parameters have another dtype (the KDA attention's f32 `A_log`) becomes a
    group of that dtype, after its children of other dtypes (its bf16 projections) got their own groups. Returns
    the names of the groups made, children first."""
    from torch.distributed.fsdp import FSDPModule

    grouped = []
    for name, child in module.named_children():
        if isinstance(child, FSDPModule) or _subtree_dtypes(child) <= {main}:
            continue
        own = {p.dtype for p in child.parameters(recurse=False)}
        if len(own) > 1:
            raise ValueError(f"{type(child).__name__} ({name}) holds parameters of several dtypes "
                             f"{sorted(map(str, own))}; FSDP2 shards one dtype per group")
        child_main = own.pop() if own else main
        grouped += [f"{name}.{sub}" for sub in _shard_dtype_groups(child, child_main, fully_shard, **kwargs)]
        if child_main != main:
            fully_shard(child, **kwargs)
            grouped.append(name)
    return grouped


def shard_model(
    model: nn.Module,
    mesh=None,
    reshard_after_forward: bool = True,
    gradient_checkpointing: bool = False,
    reduce_dtype: torch.dtype | None = None,
) -> nn.Module:
    """Shard a Kimi K3 model with FSDP2 in place and return it.

    Call after `torch.distributed` is initialised and the model sits on this rank's device. `mesh`: a 1-D
    DeviceMesh (default: the world). `gradient_checkpointing` recomputes each decoder layer in backward
    (non-reentrant, as FSDP2 needs). `reduce_dtype` (e.g. torch.float32) sets the gradient reduce-scatter dtype; the
    parameters keep their own dtypes (f32 islands stay f32).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if gradient_checkpointing:
        enable_checkpointing(model, use_reentrant=False)
    kwargs = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if reduce_dtype is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    for layer in decoder_layers(model):
        _shard_dtype_groups(layer, _main_dtype(layer), fully_shard, **kwargs)
        fully_shard(layer, **kwargs)
    _shard_dtype_groups(model, _main_dtype(model), fully_shard, **kwargs)
    fully_shard(model, **kwargs)
    return model


def trainer_fsdp_args(gradient_checkpointing: bool = True, reshard_after_forward: bool = True) -> dict:
    """`TrainingArguments(**trainer_fsdp_args(), ...)`: FSDP2 through accelerate, one unit per decoder layer, FSDP's
    own activation checkpointing. Launch with `torchrun` or `accelerate launch`.

    accelerate puts each decoder layer in one parameter group, so its parameters must share one dtype: load the
    model in f32 for this path (or train bf16 weights with `shard_model`, which groups the f32 islands apart).
    """
    # fsdp=True (full sharding) with everything in fsdp_config: the string form is deprecated in transformers 5.x
    return {
        "fsdp": True,
        "fsdp_config": {
            "version": 2,
            "transformer_layer_cls_to_wrap": [DECODER_LAYER_CLASS],
            "reshard_after_forward": reshard_after_forward,
            "activation_checkpointing": gradient_checkpointing,
        },
    }


__all__ = ["decoder_layers", "shard_model", "trainer_fsdp_args"]
