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
"""Differences between the transformers versions this code supports (5.17 through the newest 5.x), in one place.

The model files ask this module instead of naming a version: each bridge says which versions differ and how.
"""

import importlib.util

from transformers.modeling_outputs import MoeModelOutputWithPast
from transformers.modeling_utils import PreTrainedModel

try:  # transformers 5.0 through 5.24 register weight conversions for a model class by its model type
    from transformers.conversion_mapping import register_checkpoint_conversion_mapping
except ImportError:  # pragma: no cover - a transformers without checkpoint conversion mappings
    register_checkpoint_conversion_mapping = None

# Expert parallelism: transformers >= 5.21 dispatches tokens to the ranks' experts itself (`ep_dispatch_experts`, the
# `transformers.distributed.expert_parallel` module, `DistributedConfig(ep_size=...)`): at inference on a shared
# batch it masks the other ranks' routes and all-reduces, in training it exchanges tokens all-to-all. 5.17 to 5.20
# mask at the router (`ep_router`) and all-reduce the experts' outputs (`moe_tp_experts`), selected with
# `DistributedConfig(enable_expert_parallel=True)`.
HAS_EP_DISPATCH = importlib.util.find_spec("transformers.distributed.expert_parallel") is not None

# transformers 5.24 renamed the cache argument and output field from `past_key_values` to `cache` (5.17 uses the
# old name). Forward accepts both; outputs and generate() use whichever this transformers expects.
CACHE_FIELD = "cache" if "cache" in MoeModelOutputWithPast.__dataclass_fields__ else "past_key_values"
# Both names, for the lists transformers reads by argument name (accelerate's device placement skips them)
CACHE_ARGUMENTS = ("cache", "past_key_values")


def given_cache(cache, past_key_values):
    """The cache a caller passed, under either name."""
    return cache if cache is not None else past_key_values


def cache_in(kwargs: dict):
    """The cache in a dict of forward or generation keyword arguments, under either name."""
    return given_cache(kwargs.get("cache"), kwargs.get("past_key_values"))


def activation_checkpointing_on(model: PreTrainedModel) -> bool:
    """Whether activation (gradient) checkpointing is on. transformers 5.23 renamed `is_gradient_checkpointing` to
    `is_activation_checkpointing`, and answers the old name with a FutureWarning; PEFT's get_peft_model reads the old
    name, so our models answer it through this (same answer as transformers', no warning)."""
    if hasattr(PreTrainedModel, "is_activation_checkpointing"):
        return model.is_activation_checkpointing
    return PreTrainedModel.is_gradient_checkpointing.fget(model)
