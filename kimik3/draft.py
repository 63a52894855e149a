"""A draft model for speculative decoding, sliced from the target: `generate(..., assistant_model=draft)`.

The target's first layers with the layer schedule of `kimik3 convert --num-layers` (convert/schedule.py), in memory.
It stays in the package, not in the remote code: it needs the converter's schedule.
"""

from kimik3.convert.schedule import layer_map, output_text_config
from kimik3.modeling.modeling_kimi_k3 import KimiK3ForCausalLM


def slice_draft_model(model, num_layers: int) -> KimiK3ForCausalLM:
    """A draft for speculative decoding: the target's first `num_layers` layers, scheduled as
    `kimik3 convert --num-layers` does (ending with an MLA layer), with the target's embeddings, final norms and
    LM head. Its weights are copies; the target is unchanged."""
    text = model.config.get_text_config()
    mapping, _ = layer_map(text, num_layers)
    experts_format = getattr(text, "experts_format", "dense")
    draft = KimiK3ForCausalLM(output_text_config(text, mapping, None, experts_format))
    source = model.state_dict()
    prefix = "model.layers."
    if not any(key.startswith(prefix) for key in source):
        source = {key.split("language_model.", 1)[-1]: value for key, value in source.items()}
    weights = {}
    for key in draft.state_dict():
        if key.startswith(prefix):
            index, rest = key[len(prefix):].split(".", 1)
            key_in_source = f"{prefix}{mapping[int(index)]}.{rest}"
        else:
            key_in_source = key
        weights[key] = source[key_in_source]
    draft.load_state_dict(weights, strict=True)
    return draft.to(model.device, model.dtype).eval()


__all__ = ["slice_draft_model"]
