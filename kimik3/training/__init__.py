"""Fine-tuning helpers for Kimi K3: Quantile Balancing of the router bias, LoRA targets, data and memory tools.

The model-independent parts import nothing from the model; see docs/training.md.
"""

from .checkpointing import checkpointing_arguments, enable_checkpointing
from .outputs import carry_tokenizer_files
from .quantile_balancing import (
    ExpertLoadCallback,
    ExpertLoadMonitor,
    QuantileBalancer,
    QuantileBalancingCallback,
    estimate_bias_histogram,
    exact_bias,
    load_router_bias_state_dict,
    router_bias_state_dict,
)

__all__ = [
    "carry_tokenizer_files",
    "checkpointing_arguments",
    "enable_checkpointing",
    "ExpertLoadCallback",
    "ExpertLoadMonitor",
    "QuantileBalancer",
    "QuantileBalancingCallback",
    "estimate_bias_histogram",
    "exact_bias",
    "load_router_bias_state_dict",
    "router_bias_state_dict",
]
