"""A draft model for speculative decoding, sliced from the target: `generate(..., assistant_model=draft)`.

The target's first layers with the layer schedule of `kimik3 convert --num-layers` (convert/schedule.py), in memory.
It stays in the package, not in the remote code: it needs the converter's schedule.
"""

import importlib

from kimik3.convert.schedule import layer_map, output_text_config


def _target_classes(model) -> tuple[type, type]:
    """(text config class, causal-LM class) of the code the target runs. A folder loaded with trust_remote_code
    runs its own copy of the remote code (`transformers_modules.<folder>.*`), whose cache classes are not the
    installed package's: a draft built from `kimik3.modeling` would hand generate() a cache the target refuses."""
    module = importlib.import_module(type(model).__module__)
    causal_lm = getattr(module, "KimiK3ForCausalLM", None)
    if causal_lm is None:  # the multimodal model's file imports the text model from its sibling
        package = type(model).__module__.rpartition(".")[0]
        causal_lm = importlib.import_module(f"{package}.modeling_kimi_k3" if package else "modeling_kimi_k3")
        causal_lm = causal_lm.KimiK3ForCausalLM
    return causal_lm.config_class, causal_lm


def slice_draft_model(model, num_layers: int):
    """A draft for speculative decoding: the target's first `num_layers` layers, scheduled as
    `kimik3 convert --num-layers` does (ending with an MLA layer), with the target's embeddings, final norms and
    LM head, built from the target's own classes (those of its folder's code when loaded with trust_remote_code).
    Its weights are copies; the target is unchanged."""
    text = model.config.get_text_config()
    mapping, _ = layer_map(text, num_layers)
    experts_format = getattr(text, "experts_format", "dense")
    config_class, causal_lm = _target_classes(model)
    config = output_text_config(text, mapping, None, experts_format)
    draft = causal_lm(config_class(**config.to_dict()))
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
