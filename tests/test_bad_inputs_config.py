"""Config values the model and the converter would otherwise ignore or trip on (docs/bad_inputs.md, "Config values")."""

import json
import time

import pytest
import torch

from kimik3.configuration import released_config_dict, tiny_text_config_dict
from kimik3.convert.checkpoint import config_from_dict
from kimik3.convert.errors import ConversionError
from kimik3.modeling.configuration_kimi_k3 import MAX_HIDDEN_LAYERS, KimiK3Config, KimiK3TextConfig

VOCAB = 128  # the tiny text config's vocabulary


def text(**changes) -> dict:
    cfg = tiny_text_config_dict()
    cfg.update(changes)
    return cfg


def release(change) -> dict:
    cfg = released_config_dict()
    change(cfg)
    return cfg


def _quant_group(cfg, **weights):
    cfg["text_config"]["quantization_config"]["config_groups"]["group_0"]["weights"].update(weights)


BAD_TEXT = [
    pytest.param(text(eos_token_id=VOCAB), "eos_token_id", r"128 must be a token id or a list of token ids in "
                 r"\[0, vocab_size=128\) or null", id="eos-id-out-of-vocab"),
    pytest.param(text(eos_token_id=[2, 500]), "eos_token_id", r"the list \[2, 500\] must hold token ids in "
                 r"\[0, vocab_size=128\); \[500\] are not", id="eos-id-list-out-of-vocab"),
    pytest.param(text(eos_token_id=[]), "eos_token_id", r"the list \[\] must hold token ids", id="eos-id-empty-list"),
    pytest.param(text(pad_token_id=-1), "pad_token_id", r"-1 must be a token id in \[0, vocab_size=128\)",
                 id="pad-id-negative"),
    pytest.param(text(bos_token_id=1.0), "bos_token_id", r"1.0 must be a token id", id="bos-id-float"),
    pytest.param(text(model_type="llama"), "model_type", r"'llama' is not a Kimi K3 config \(expected one of "
                 r"\['kimi_linear', 'kimik3_text'\]\)", id="model-type-other"),
    pytest.param(text(dtype="float7"), "dtype", r"'float7' is not a floating dtype \(expected one of \['bfloat16', "
                 r"'float16', 'float32', 'float64'\]\)", id="dtype-float7"),
    pytest.param(text(torch_dtype="float7"), "torch_dtype", r"'float7' is not a floating dtype",
                 id="torch-dtype-float7"),
    pytest.param(text(dtype="int8"), "dtype", r"'int8' is not a floating dtype", id="dtype-int8"),
    pytest.param(text(num_hidden_layers=10**9), "num_hidden_layers", rf"1000000000 is more than the "
                 rf"{MAX_HIDDEN_LAYERS} layers a Kimi K3 config may have", id="num-hidden-layers-1e9"),
    pytest.param(text(num_hidden_layers=MAX_HIDDEN_LAYERS + 1, linear_attn_config=None), "num_hidden_layers",
                 "4097 is more than", id="num-hidden-layers-above-bound-no-lists"),
]


@pytest.mark.parametrize("cfg, key, message", BAD_TEXT)
def test_bad_text_config_value_is_a_value_error_naming_the_key(cfg, key, message):
    start = time.perf_counter()
    with pytest.raises(ValueError, match=rf"key `{key}`: {message}"):
        KimiK3TextConfig(**cfg)
    assert time.perf_counter() - start < 1.0  # refused before anything is derived from the value


BAD_RELEASE = [
    pytest.param(release(lambda c: c.update(eos_token_id=163840)), "eos_token_id",
                 r"163840 must be a token id .*vocab_size=163840", id="top-level-eos-id-out-of-vocab"),
    pytest.param(release(lambda c: c["text_config"].update(pad_token_id=200000)), "text_config.pad_token_id",
                 r"200000 must be a token id", id="text-config-pad-id-out-of-vocab"),
    pytest.param(release(lambda c: c.update(model_type="llava")), "model_type",
                 r"'llava' is not a Kimi K3 config \(expected one of \['kimi_k3', 'kimik3'\]\)",
                 id="composite-model-type-other"),
    pytest.param(release(lambda c: c["text_config"].update(model_type="deepseek_v3")), "text_config.model_type",
                 r"'deepseek_v3' is not a Kimi K3 config", id="text-config-model-type-other"),
    pytest.param(release(lambda c: c.update(dtype="float7")), "dtype", r"'float7' is not a floating dtype",
                 id="composite-dtype-float7"),
    pytest.param(release(lambda c: c["vision_config"].update(vt_num_attention_heads=7)),
                 "vision_config.vt_num_attention_heads", r"7 heads do not divide qkv_hidden_size=1536",
                 id="vision-heads-not-dividing-width"),
    pytest.param(release(lambda c: c["vision_config"].update(vt_num_attention_heads=256)),
                 "vision_config.vt_num_attention_heads", r"256 heads give a head dim of 6 .*needs a multiple of 4",
                 id="vision-head-dim-not-multiple-of-4"),
    pytest.param(release(lambda c: c["vision_config"].update(vt_num_attention_heads=0)),
                 "vision_config.vt_num_attention_heads", r"must be a positive integer, got 0", id="vision-heads-zero"),
    pytest.param(release(lambda c: c["vision_config"].update(patch_size=0)), "vision_config.patch_size",
                 r"must be a positive integer, got 0", id="vision-config-patch-size-zero"),
    pytest.param(release(lambda c: c["vision_config"].update(merge_kernel_size=[2, 0])),
                 "vision_config.merge_kernel_size", r"must be a positive integer or a list of two, got \[2, 0\]",
                 id="vision-config-merge-kernel-zero"),
    pytest.param(release(lambda c: _quant_group(c, group_size=16)),
                 "text_config.quantization_config.config_groups.group_0.weights.group_size",
                 r"16: the MXFP4 experts are decoded in groups of 32", id="quant-group-size-16"),
    pytest.param(release(lambda c: c["text_config"]["quantization_config"].update(format="nvfp4-pack-quantized")),
                 "text_config.quantization_config.format",
                 r"'nvfp4-pack-quantized' is not a format Kimi K3 decodes \(only 'mxfp4-pack-quantized'\)",
                 id="quant-format-unknown"),
    pytest.param(release(lambda c: c["text_config"]["quantization_config"].update(quant_method="gptq")),
                 "text_config.quantization_config.quant_method", r"'gptq': Kimi K3 reads only", id="quant-method-other"),
]


@pytest.mark.parametrize("cfg, key, message", BAD_RELEASE)
def test_bad_release_config_value_is_a_value_error_naming_the_key(cfg, key, message):
    with pytest.raises(ValueError, match=rf"key `{key}`: {message}"):
        KimiK3Config(**cfg)


def test_the_converter_names_config_json_and_the_key(tmp_path):
    cfg = release(lambda c: c.update(eos_token_id=[163586, 163840]))
    with pytest.raises(ConversionError, match=rf"{tmp_path}/config.json: cannot be read as a Kimi K3 config: .*key "
                                              r"`eos_token_id`: the list \[163586, 163840\]"):
        config_from_dict(cfg, tmp_path)


def test_from_pretrained_refuses_a_bad_config_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(text(dtype="float7", model_type="kimik3_text")))
    with pytest.raises(ValueError, match=r"key `dtype`: 'float7' is not a floating dtype"):
        KimiK3TextConfig.from_pretrained(tmp_path)


GOOD = [
    pytest.param(text(eos_token_id=[1, 2]), id="eos-id-list-in-vocab"),
    pytest.param(text(pad_token_id=None, bos_token_id=None, eos_token_id=None), id="token-ids-null"),
    pytest.param(text(pad_token_id=VOCAB - 1), id="pad-id-last-of-vocab"),
    pytest.param(text(dtype="float16", model_type="kimi_linear"), id="dtype-float16-model-type-release"),
    pytest.param(text(torch_dtype=torch.float32), id="torch-dtype-object"),
    pytest.param(text(num_hidden_layers=MAX_HIDDEN_LAYERS, linear_attn_config=None), id="num-hidden-layers-at-bound"),
]


@pytest.mark.parametrize("cfg", GOOD)
def test_good_neighbours_are_accepted(cfg):
    config = KimiK3TextConfig(**cfg)
    assert config.eos_token_id == cfg["eos_token_id"] and len(config.layer_types) == cfg["num_hidden_layers"]


def test_a_composite_around_a_small_text_config_keeps_the_default_top_level_ids():
    """The release's top-level ids are only checked when given: `KimiK3Config(text_config=tiny)` (how export wraps a
    text-only folder) still builds."""
    config = KimiK3Config(text_config=KimiK3TextConfig(**text()), vision_config={})
    assert (config.pad_token_id, config.eos_token_id) == (163839, 163586)
