"""Unit tests of the converter's parts: the name map against the release's 60 tensor patterns, the streaming
safetensors reader/writer against the `safetensors` library, the fixture writer, MXFP4 and the layer schedule."""

import json
import re
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from kimik3.configuration import RELEASED_CONFIG_PATH, TENSOR_PATTERNS_PATH
from kimik3 import name_map as nm
from kimik3.convert import mxfp4, safetensors_io as sio, schedule, testing
from kimik3.convert.errors import ConversionError
from kimik3.modeling.configuration_kimi_k3 import KimiK3Config
from kimik3.modeling.saving_kimi_k3 import COMPOSITE_AUTO_MAP

PATTERNS = json.loads(TENSOR_PATTERNS_PATH.read_text())["patterns"]
RELEASE_CONFIG = json.loads(RELEASED_CONFIG_PATH.read_text())


def _release_config():
    return KimiK3Config(**json.loads(json.dumps(RELEASE_CONFIG)))


def _layers(spec):
    if spec is None:
        return [None]
    out = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def test_every_release_pattern_maps_to_one_rule_with_the_release_shape_and_dtype():
    config = _release_config()
    text, symbols = config.text_config, nm.dims(config.text_config, config.vision_config)
    seen_rules = set()
    for pattern in PATTERNS:
        for layer in _layers(pattern["layers_0based"]):
            name = pattern["pattern"].replace("{L}", str(layer)).replace("{E}", "895").replace("{B}", "26")
            scope = "text" if name.startswith("language_model.") else "vision"
            match = nm.match_release(name.removeprefix("language_model."), text, scope)
            assert match is not None, name
            if isinstance(match.rule, nm.ExpertRule):
                logical = nm.shape_of(match.rule.part_shape, symbols)
                expected = dict(zip(("weight_packed", "weight_scale"), mxfp4.packed_shapes(logical)))[match.suffix]
                assert list(expected) == pattern["shape"] and pattern["dtype"] == "U8", name
            else:
                assert list(nm.shape_of(match.rule.shape, symbols)) == pattern["shape"], name
                assert match.rule.dtype == pattern["dtype"], name
                seen_rules.add(match.rule)
    # the layer sets of the release are exactly where each rule's conditions hold
    for pattern in PATTERNS:
        if pattern["layers_0based"] is None or ".experts." in pattern["pattern"]:
            continue
        rel = pattern["pattern"].removeprefix("language_model.")
        holds = [
            layer for layer in range(93)
            if nm.match_release(rel.replace("{L}", str(layer)), text) is not None
        ]
        assert holds == _layers(pattern["layers_0based"]), pattern["pattern"]


def test_release_names_that_exist_only_on_other_layer_types_do_not_match():
    text = _release_config().text_config
    # layer 3 is MLA: no KDA q_proj, A_log; layer 0 is dense: no router
    assert nm.match_release("model.layers.3.self_attn.q_proj.weight", text) is None
    assert nm.match_release("model.layers.3.self_attn.A_log", text) is None
    assert nm.match_release("model.layers.0.block_sparse_moe.gate.weight", text) is None
    assert nm.match_release("model.layers.1.mlp.gate_proj.weight", text) is None
    assert nm.match_release("model.layers.1.block_sparse_moe.experts.0.w4.weight_packed", text) is None
    assert nm.match_release("model.layers.01.input_layernorm.weight", text) is None  # no aliases of layer 1
    # g_proj: one name, two meanings
    kda, mla = (nm.match_release(f"model.layers.{i}.self_attn.g_proj.weight", text) for i in (0, 3))
    assert kda.rule.when == ("kda", "full_rank_gate") and mla.rule.when == ("mla", "mla_gate")


def test_our_names_match_the_design_contract():
    text = _release_config().text_config
    expected = {
        "model.layers.1.mlp.experts.gate_up_proj": "",
        "model.layers.1.mlp.experts.down_proj_packed": "_packed",
        "model.layers.1.mlp.experts.gate_up_proj_scale": "_scale",
    }
    for name, suffix in expected.items():
        assert nm.match_ours(name, text).suffix == suffix
    assert nm.match_ours("model.layers.1.mlp.gate.e_score_correction_bias", text).rule.transform == "first_experts"
    assert nm.match_ours("model.layers.0.self_attn.A_log", text).rule.transform == "unpad_heads"
    assert nm.match_ours("model.layers.1.block_sparse_moe.gate.weight", text) is None


def test_fixture_has_exactly_the_release_name_patterns_dtypes_and_shard_rule(tmp_path):
    fx = testing.write_release_checkpoint(tmp_path / "fx", num_layers=9, num_experts=4)
    index = json.loads((tmp_path / "fx" / "model.safetensors.index.json").read_text())["weight_map"]
    generalised = {
        re.sub(r"experts\.\d+\.", "experts.{E}.", re.sub(r"layers\.\d+\.", "layers.{L}.",
               re.sub(r"blocks\.\d+\.", "blocks.{B}.", name)))
        for name in index
    }
    assert generalised == {p["pattern"] for p in PATTERNS}
    dtypes = {p["pattern"]: p["dtype"] for p in PATTERNS}
    for shard in fx.shards:
        assert re.fullmatch(r"model-\d{5}-of-000012\.safetensors", shard)
        with safe_open(str(tmp_path / "fx" / shard), "pt") as handle:
            for name in handle.keys():
                pattern = re.sub(r"experts\.\d+\.", "experts.{E}.", re.sub(r"layers\.\d+\.", "layers.{L}.",
                                 re.sub(r"blocks\.\d+\.", "blocks.{B}.", name)))
                assert sio.DTYPE_NAMES[handle.get_tensor(name).dtype] == dtypes[pattern], name
    # one decoder layer per shard (shard k = layer k-1), then embed/head, projector, vision
    for name, shard in index.items():
        layer = re.match(r"language_model\.model\.layers\.(\d+)\.", name)
        k = int(shard[6:11])
        if layer:
            assert k == int(layer.group(1)) + 1
        elif name.startswith("language_model."):
            assert k == 10
        else:
            assert k == (11 if name.startswith("mm_projector.") else 12)
    # 1-based layer lists ending with two MLA layers, A_log zero padded to 128
    lac = fx.config["text_config"]["linear_attn_config"]
    assert lac["full_attn_layers"] == [4, 8, 9] and lac["kda_layers"] == [1, 2, 3, 5, 6, 7]
    a_log = fx.dense["language_model.model.layers.0.self_attn.A_log"]
    assert a_log.shape == (128,) and torch.all(a_log[2:] == 0) and torch.all(a_log[:2] > 0)
    # the config loads through our config class and keeps the released structure
    assert set(fx.config) == set(RELEASE_CONFIG)
    assert set(fx.config["text_config"]) == set(RELEASE_CONFIG["text_config"])


def test_fixture_experts_decode_to_the_returned_dense_values_with_an_independent_decoder(tmp_path):
    fx = testing.write_release_checkpoint(tmp_path / "fx", num_layers=2, num_experts=2, vision=False)
    name = "language_model.model.layers.1.block_sparse_moe.experts.1.w2"
    tensors = load_file(str(tmp_path / "fx" / fx.shards[1]))
    packed, scale = tensors[name + ".weight_packed"], tensors[name + ".weight_scale"]
    magnitudes = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    dense = fx.dense[name + ".weight"]
    assert dense.shape == (packed.shape[0], packed.shape[1] * 2)
    for row in range(dense.shape[0]):
        for col in range(dense.shape[1]):
            byte = int(packed[row, col // 2])
            code = byte & 0xF if col % 2 == 0 else byte >> 4  # low nibble = even element
            value = (-1 if code & 8 else 1) * magnitudes[code & 7] * 2.0 ** (int(scale[row, col // 32]) - 127)
            assert float(dense[row, col]) == value


def test_reader_and_writer_agree_with_the_safetensors_library(tmp_path):
    tensors = {
        "a": torch.randn(3, 5).to(torch.bfloat16),
        "b": torch.arange(7, dtype=torch.uint8),
        "c": torch.randn(2, 1, 4),
        "empty": torch.zeros(0, 3),
    }
    save_file(tensors, str(tmp_path / "lib.safetensors"))
    with sio.ShardReader(tmp_path / "lib.safetensors", chunk_bytes=4) as reader:
        for name, value in tensors.items():
            assert torch.equal(reader.read(name), value)
            chunks = list(reader.iter_byte_chunks(name))
            assert all(c.numel() <= 4 for c in chunks)
    specs = sio.layout_order([sio.OutSpec(n, sio.DTYPE_NAMES[v.dtype], tuple(v.shape)) for n, v in tensors.items()])
    writer = sio.ShardWriter(tmp_path / "ours.safetensors", specs, {"format": "pt"})
    for spec in specs:
        value = tensors[spec.name]
        # split into uint8 pieces to prove chunked writes lay out the same bytes
        raw = value.contiguous().reshape(-1).view(torch.uint8)
        writer.write_tensor(spec, [raw[:3], raw[3:]])
    writer.close()
    loaded = load_file(str(tmp_path / "ours.safetensors"))
    assert set(loaded) == set(tensors) and all(torch.equal(loaded[k], v) for k, v in tensors.items())
    header_len = struct.unpack("<Q", (tmp_path / "ours.safetensors").read_bytes()[:8])[0]
    assert header_len % 8 == 0  # data section 8-aligned; F32 first so every tensor is aligned
    assert [s.dtype for s in specs] == ["F32", "F32", "BF16", "U8"]


def test_writer_refuses_a_producer_that_gives_the_wrong_number_of_bytes(tmp_path):
    spec = sio.OutSpec("x", "F32", (4,))
    writer = sio.ShardWriter(tmp_path / "x.safetensors", [spec])
    with pytest.raises(RuntimeError, match="producer gave 12 bytes, the plan says 16"):
        writer.write_tensor(spec, [torch.zeros(3)])
    writer.abort()


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda b: b[:5], "not even the 8-byte header length"),
        (lambda b: struct.pack("<Q", 10**7) + b[8:], "truncated or corrupted safetensors header"),
        (lambda b: b[:8] + b"{nonsense" + b[17:], "corrupted safetensors header"),
        (lambda b: b[:-10], "file is truncated"),
    ],
)
def test_reader_names_the_file_for_damaged_headers(tmp_path, damage, message):
    path = tmp_path / "shard.safetensors"
    save_file({"w": torch.ones(4, 4)}, str(path))
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(ConversionError, match=message) as info:
        sio.read_header(path)
    assert "shard.safetensors" in str(info.value)


def test_mxfp4_dequantise_then_quantise_is_bit_exact_for_round_trip_stable_codes():
    gen = torch.Generator().manual_seed(3)
    packed, scale = testing.random_mxfp4(gen, 64, 96)
    dense = mxfp4.dequantize_mxfp4(packed, scale)
    again_packed, again_scale = mxfp4.quantize_mxfp4(dense)
    assert torch.equal(again_packed, packed) and torch.equal(again_scale, scale)


def test_layer_map_reschedules_the_last_kept_layer_to_mla():
    text = _release_config().text_config
    mapping, note = schedule.layer_map(text, 13)
    assert mapping == list(range(12)) + [15] and "source layer 15" in note
    assert schedule.layer_map(text, 12) == (list(range(11)) + [11], None)  # layer 11 is MLA already
    assert schedule.layer_map(text, 93) == (list(range(93)), None)
    with pytest.raises(ConversionError, match="93 layers"):
        schedule.layer_map(text, 94)
    out = schedule.output_text_config(text, mapping, 64, "dense")
    assert out.linear_attn_config["full_attn_layers"] == [4, 8, 12, 13]
    assert out.layer_types[12] == "full_attention" and out.num_experts == 64 and out.num_experts_per_token == 16
    # AttnRes blocks are defined by layer index, so a prefix keeps the same block starts
    assert out.attn_res_block_size == 12


def test_release_config_round_trips_through_our_config_and_export():
    config = _release_config()
    converted = schedule.output_config_dict(config, schedule.output_text_config(
        config.text_config, list(range(93)), None, "dense"), False)
    assert converted["auto_map"] == COMPOSITE_AUTO_MAP and "quantization_config" not in converted[
        "text_config"]
    reloaded = KimiK3Config(**json.loads(json.dumps(converted)))
    exported = json.dumps(schedule.release_config_dict(reloaded), indent=2, sort_keys=True)
    assert exported == RELEASED_CONFIG_PATH.read_text()


def test_experts_format_flag_reads_the_configs_vocabulary():
    from kimik3.convert import cli
    from kimik3.modeling.configuration_kimi_k3 import DEFAULT_EXPERTS_FORMAT, EXPERTS_FORMATS

    parse = cli._convert_parser().parse_args
    assert parse(["src", "dst"]).experts_format == DEFAULT_EXPERTS_FORMAT == "dense"
    for value in EXPERTS_FORMATS:
        assert parse(["src", "dst", "--experts-format", value]).experts_format == value
    assert "--experts-dtype" not in cli._convert_parser().format_help()


def test_shard_sizes_are_read_like_transformers_reads_max_shard_size():
    from kimik3.convert.converter import parse_size

    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30 and parse_size("120KB") == 120_000
    assert parse_size("4096") == 4096 and parse_size(4096) == 4096
    for bad in ("0", "-1MB", "five GB", "", True):
        with pytest.raises(ConversionError, match="positive size"):
            parse_size(bad)
