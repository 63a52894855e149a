"""Config values the model and the converter would otherwise ignore or trip on (docs/bad_inputs.md, "Config values"),
and MXFP4 scale bytes that are valid but overflow the dtype the weights are decoded to (the E8M0 rows of "Reading and
values")."""

import json
import shutil
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

import kimik3.convert as kc

from kimik3.configuration import released_config_dict, tiny_text_config_dict
from kimik3.convert import testing
from kimik3.convert.checkpoint import config_from_dict
from kimik3.convert.errors import ConversionError
from kimik3.convert.mxfp4 import dequantize_into
from kimik3.modeling.files_kimi_k3 import KimiK3LoadError
from kimik3.modeling.multimodal_kimi_k3 import KimiK3ForConditionalGeneration
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
                 r"\[0, vocab_size=128\), -1 \(never stop\) or null", id="eos-id-out-of-vocab"),
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
    pytest.param(text(topk_method="foo"), "topk_method", r"'foo' is not one the model implements \['noaux_tc'\]",
                 id="topk-method-foo"),
    pytest.param(text(use_cache="no"), "use_cache", "must be true or false, got 'no'", id="use-cache-string"),
    pytest.param(text(tie_word_embeddings="yes"), "tie_word_embeddings", "must be true or false, got 'yes'",
                 id="tie-word-embeddings-string"),
    pytest.param(text(use_grouped_topk=1), "use_grouped_topk", "must be true or false, got 1",
                 id="use-grouped-topk-int"),
    pytest.param(text(num_experts=0, num_hidden_layers=2, mlp_layer_types=["dense", "sparse"],
                      linear_attn_config={**tiny_text_config_dict()["linear_attn_config"], "kda_layers": [1],
                                          "full_attn_layers": [2]}),
                 "num_experts", r"0 leaves no routed experts, so every MLP is dense, yet mlp_layer_types marks "
                 r"layers \[1\] sparse", id="num-experts-zero-with-sparse-layers"),
    pytest.param(text(vocab_size=10**12), "vocab_size", "1,000,000,000,000 is more than the 16,777,216 token ids",
                 id="vocab-size-1e12"),
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
                 "text_config.quantization_config.quant_method", r"'gptq': Kimi K3 reads only",
                 id="quant-method-other"),
    pytest.param(release(lambda c: _quant_group(c, num_bits=8)),
                 "text_config.quantization_config.config_groups.group_0.weights.num_bits",
                 r"8: the experts are decoded as MXFP4, 4 bits a value", id="quant-num-bits-8"),
    pytest.param(release(lambda c: c["text_config"]["quantization_config"]["config_groups"]["group_0"].update(
                     weights=5)), "text_config.quantization_config.config_groups.group_0.weights",
                 r"must be a JSON object, got 5", id="quant-weights-not-an-object"),
    pytest.param(release(lambda c: _quant_group(c, group_size=True)),
                 "text_config.quantization_config.config_groups.group_0.weights.group_size",
                 r"True: the MXFP4 experts are decoded in groups of 32", id="quant-group-size-true"),
    pytest.param(release(lambda c: c.update(dtype="float8_e4m3fn")), "dtype",
                 r"'float8_e4m3fn' is not a floating dtype \(expected one of \['bfloat16'", id="dtype-float8"),
    pytest.param(release(lambda c: c.update(media_placeholder_token_id="163605")), "media_placeholder_token_id",
                 r"'163605' must be a token id \(a whole number\) or null", id="media-placeholder-id-str"),
    pytest.param(release(lambda c: c.update(media_placeholder_token_id=True)), "media_placeholder_token_id",
                 r"True must be a token id", id="media-placeholder-id-bool"),
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


# ------------------------------------------------------------------------------------------------------------------
# E8M0 overflow: a valid scale byte (0x00..0xFE) times a valid code can still be beyond the dtype's range. Each
# value must be finite in the dtype it is written in (convert, export) or decoded to (load; kept-packed experts are
# decoded to the model's dtype at every forward, so their bytes are checked at load).

CODE_6, CODE_2, CODE_1_5 = 0x07, 0x04, 0x03  # E2M1 codes of 6.0, 2.0 and 1.5 (low nibble: the group's first weight)


def _group(byte: int, code: int):
    packed = torch.zeros(3, 32, dtype=torch.uint8)  # [rows, K/2]: K = 64, two groups per row
    scale = torch.full((3, 2), 127, dtype=torch.uint8)
    packed[2, 16] = code  # row 2, group 1
    scale[2, 1] = byte
    return packed, scale


OVERFLOWS = [
    pytest.param(0xFE, CODE_6, torch.bfloat16, r"0xFE at \[2, 1\] with code 6.0 gives inf in bfloat16",
                 id="e8m0-0xfe-code-6-bf16"),
    pytest.param(0xFE, CODE_2, torch.float32, r"0xFE at \[2, 1\] with code 2.0 gives inf in float32",
                 id="e8m0-0xfe-code-2-f32"),
    pytest.param(0xFE, CODE_6 | 0x8, torch.bfloat16, r"0xFE at \[2, 1\] with code -6.0 gives -inf in bfloat16",
                 id="e8m0-0xfe-code-minus-6-bf16"),
    # fp16's largest finite value is 65504: 6.0 x 2^14 (byte 0x8D) is already beyond it
    pytest.param(0x8D, CODE_6, torch.float16, r"0x8D at \[2, 1\] with code 6.0 gives inf in float16",
                 id="e8m0-0x8d-code-6-fp16"),
]


@pytest.mark.parametrize("byte, code, dtype, message", OVERFLOWS)
def test_a_scale_that_overflows_the_target_dtype_is_refused(byte, code, dtype, message):
    packed, scale = _group(byte, code)
    assert not torch.isfinite(testing.dequantize_mxfp4(packed, scale, dtype)).all()  # what would have been written
    out = torch.zeros(3, 64, dtype=dtype)
    with pytest.raises(ConversionError, match=rf"^w.safetensors, tensor `w`: E8M0 scale byte {message}"):
        dequantize_into(out, packed, scale, "w.safetensors, tensor `w`")
    assert not out.any()  # checked before anything is written


FITS = [
    pytest.param(0xFE, CODE_1_5, torch.bfloat16, id="e8m0-0xfe-code-1.5-bf16-finite"),
    pytest.param(0xFD, 0x05, torch.float32, id="e8m0-0xfd-code-3-f32-finite"),  # 3.0 x 2^126 (4.0 would be 2^128)
    pytest.param(0x8C, CODE_6, torch.float16, id="e8m0-0x8c-code-6-fp16-finite"),
    pytest.param(0x00, CODE_6, torch.bfloat16, id="e8m0-0x00-tiny"),
    pytest.param(0xFE, 0x00, torch.bfloat16, id="e8m0-0xfe-all-zero-codes"),
]


@pytest.mark.parametrize("byte, code, dtype", FITS)
def test_large_but_finite_and_tiny_scales_decode_exactly(byte, code, dtype):
    packed, scale = _group(byte, code)
    expected = testing.dequantize_mxfp4(packed, scale, torch.float32).double()
    out = torch.empty(3, 64, dtype=dtype)
    dequantize_into(out, packed, scale, "w")
    assert torch.isfinite(out).all() and torch.equal(out.double(), expected)


EXPERT = "language_model.model.layers.1.block_sparse_moe.experts.1.w2.weight_"
FUSED = "language_model.model.layers.1.mlp.experts.down_proj_"
SHARD1 = "model-00002-of-000003.safetensors"


@pytest.fixture(scope="module")
def overflowing_release(tmp_path_factory):
    """The reading tests' 2-layer release, with expert 1's w2 row 5, group 0 scaled by 0xFE and a code of 6.0: every
    byte valid, the weight 1.5 x 2^129 (inf in bf16)."""
    root = testing.write_release_checkpoint(tmp_path_factory.mktemp("release") / "k3", seed=7, num_layers=2,
                                            num_experts=2, vision=False, return_dense=False).path
    tensors = load_file(str(root / SHARD1))
    tensors[EXPERT + "scale"][5, 0] = 0xFE
    tensors[EXPERT + "packed"][5, :16] = 0  # group 0: its first weight 6.0, the others 0
    tensors[EXPERT + "packed"][5, 0] = CODE_6
    save_file(tensors, str(root / SHARD1), metadata={"format": "pt"})
    return root


@pytest.mark.parametrize("case", [pytest.param("dense", id="e8m0-overflow-convert-dense")])
def test_convert_dense_refuses_an_overflowing_scale(overflowing_release, tmp_path, case):
    dst = tmp_path / "out"
    with pytest.raises(ConversionError, match=rf"{SHARD1}, tensor `{EXPERT}scale`: E8M0 scale byte 0xFE at "
                                              r"\[5, 0\] with code 6.0 gives inf in bfloat16"):
        kc.convert(overflowing_release, dst, progress=False)
    assert not (dst / "config.json").exists() and not (dst / "model.safetensors.index.json").exists()


@pytest.mark.parametrize("experts_format", [pytest.param("dense", id="e8m0-overflow-direct-load-dense"),
                                            pytest.param("mxfp4", id="e8m0-overflow-direct-load-packed")])
def test_direct_release_load_refuses_an_overflowing_scale(overflowing_release, experts_format):
    """dense: dequantised at load, to the model's dtype; mxfp4: kept packed and dequantised at every forward, so
    the bytes are checked against the compute dtype at load."""
    with pytest.raises(KimiK3LoadError, match=rf"`{EXPERT}scale`.*E8M0 scale byte 0xFE at \[(1, )?5, 0\] with "
                                              r"code 6.0 gives inf in bfloat16"):
        KimiK3ForConditionalGeneration.from_pretrained(overflowing_release, experts_format=experts_format,
                                                       dtype=torch.bfloat16)


@pytest.mark.parametrize("case", [pytest.param("mxfp4", id="e8m0-overflow-kept-packed-load-and-export")])
def test_kept_packed_convert_then_load_and_export_refuse_it(overflowing_release, tmp_path, case):
    """Convert keeps the bytes (they decode at run time); loading the converted folder and exporting it refuse them,
    naming our fused tensor at [expert, row, group]."""
    packed = tmp_path / "packed"
    kc.convert(overflowing_release, packed, experts_format="mxfp4", progress=False)
    with pytest.raises(KimiK3LoadError, match=r"our `language_model.model.layers.1.mlp.experts.down_proj_scale`\): "
                                              r"E8M0 scale byte 0xFE at \[1, 5, 0\] with code 6.0 gives inf"):
        KimiK3ForConditionalGeneration.from_pretrained(packed, dtype=torch.bfloat16)
    with pytest.raises(ConversionError, match=rf"tensor `{FUSED}scale`: E8M0 scale byte 0xFE at \[1, 5, 0\] with "
                                              r"code 6.0 gives inf in bfloat16"):
        kc.export(packed, tmp_path / "exported", progress=False)
    assert not (tmp_path / "exported" / "config.json").exists()
    shutil.rmtree(packed)


# ------------------------------------------------------------------------------------------------------------------
# The image processor's settings (preprocessor_config.json `media_proc_cfg`): sizes it divides by or scales with.

@pytest.mark.parametrize("setting, message", [
    pytest.param({"patch_size": 0}, r"patch_size = 0: expected a positive whole number of pixels",
                 id="processor-patch-size-zero"),
    pytest.param({"patch_size": -14}, r"patch_size = -14: expected a positive whole number",
                 id="processor-patch-size-negative"),
    pytest.param({"patch_size": 14.0}, r"patch_size = 14.0: expected a positive whole number",
                 id="processor-patch-size-float"),
    pytest.param({"merge_kernel_size": 0}, r"merge_kernel_size = 0: expected a positive whole number or a list of two "
                 r"equal ones", id="processor-merge-kernel-zero"),
    pytest.param({"merge_kernel_size": [2, 3]}, r"merge_kernel_size = \[2, 3\]",
                 id="processor-merge-kernel-not-square"),
    pytest.param({"merge_kernel_size": "2"}, r"merge_kernel_size = '2'", id="processor-merge-kernel-str"),
    pytest.param({"in_patch_limit": 0}, r"in_patch_limit = 0: expected a positive whole number of patches",
                 id="processor-in-patch-limit-zero"),
    pytest.param({"patch_limit_on_one_side": -1}, r"patch_limit_on_one_side = -1", id="processor-side-limit-negative"),
    pytest.param({"fixed_output_tokens": 0}, r"fixed_output_tokens = 0: expected null or a positive whole number",
                 id="processor-fixed-output-tokens-zero"),
    pytest.param({"image_std": [0.5, 0.0, 0.5]}, r"image_std = \[0.5, 0.0, 0.5\]: expected a list of three finite "
                 r"positive numbers", id="processor-image-std-zero"),
    pytest.param({"image_mean": [0.5, float("nan"), 0.5]}, r"image_mean = \[0.5, nan, 0.5\]",
                 id="processor-image-mean-nan"),
])
def test_bad_image_processor_setting_names_the_key(setting, message):
    from kimik3.modeling.image_processing_kimi_k3 import KimiK3ImageProcessor

    with pytest.raises(ValueError, match=rf"^Kimi K3 image processor: media_proc_cfg\.{message}"):
        KimiK3ImageProcessor(media_proc_cfg=setting)


@pytest.mark.parametrize("setting", [pytest.param({"merge_kernel_size": [2, 2], "patch_size": 4},
                                                  id="processor-square-kernel-list-accepted")])
def test_a_square_kernel_list_is_accepted(setting):
    from PIL import Image

    from kimik3.modeling.image_processing_kimi_k3 import KimiK3ImageProcessor

    out = KimiK3ImageProcessor(media_proc_cfg=setting).preprocess([Image.new("RGB", (9, 5))])
    assert out["grid_thws"].tolist() == [[1, 2, 4]]  # padded to multiples of 8: 16 x 8 pixels


@pytest.mark.parametrize("values, message", [
    pytest.param({"eos_token_id": [163586, 163840]}, r"key `eos_token_id`: the list \[163586, 163840\] must hold token "
                 r"ids in \[0, vocab_size=163840\)", id="generation-config-eos-list-out-of-vocab"),
    pytest.param({"pad_token_id": -1}, r"key `pad_token_id`: -1 must be a token id",
                 id="generation-config-pad-negative"),
])
def test_the_converter_refuses_generation_config_token_ids_outside_the_vocabulary(tmp_path, values, message):
    from kimik3.convert import files

    (tmp_path / "generation_config.json").write_text(json.dumps({"max_length": 1048576, **values}))
    config = KimiK3Config(**released_config_dict())
    with pytest.raises(ConversionError, match=rf"^{tmp_path}/generation_config.json: Kimi K3 config, {message}"):
        files.generation_config_bytes(tmp_path, config)
