"""Bad input: a clear `ConversionError` naming the file and the tensor, and no output that looks finished."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import kimik3.convert as kc
from kimik3.convert import fixture  # noqa: E402
from kimik3.convert.errors import ConversionError  # noqa: E402

INDEX = "model.safetensors.index.json"
LAYER = "language_model.model.layers.{}."


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return fixture.write_release_checkpoint(tmp_path_factory.mktemp("release") / "k3", seed=3, num_layers=6,
                                            num_experts=4, return_dense=False)


@pytest.fixture
def release(pristine, tmp_path):
    shutil.copytree(pristine.path, tmp_path / "k3")
    pristine.path_copy = tmp_path / "k3"
    return pristine


def shard_of_layer(layer: int) -> str:
    return f"model-{layer + 1:05d}-of-000009.safetensors"


def edit_shard(root, shard, change):
    tensors = load_file(str(root / shard))
    change(tensors)
    save_file(tensors, str(root / shard), metadata={"format": "pt"})


def edit_index(root, change):
    index = json.loads((root / INDEX).read_text())
    change(index["weight_map"])
    (root / INDEX).write_text(json.dumps(index, indent=2))


def assert_convert_fails(src, dst, *fragments, **options):
    with pytest.raises(ConversionError) as info:
        kc.convert(src, dst, progress=False, **options)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, message
    assert not (dst / "config.json").exists() and not (dst / INDEX).exists()
    assert not list(dst.glob(".*.partial")) if dst.exists() else True
    return message


def test_missing_shard(release, tmp_path):
    root = release.path_copy
    (root / shard_of_layer(2)).unlink()
    assert_convert_fails(root, tmp_path / "out", shard_of_layer(2), "missing", LAYER.format(2))


def test_index_names_a_tensor_its_shard_lacks(release, tmp_path):
    root = release.path_copy
    name = LAYER.format(2) + "self_attn.q_proj.weight"
    edit_index(root, lambda wm: wm.__setitem__(name, shard_of_layer(1)))
    assert_convert_fails(root, tmp_path / "out", shard_of_layer(1), name, "header lacks it")


def test_index_lacks_an_expected_tensor(release, tmp_path):
    root = release.path_copy
    name = LAYER.format(4) + "self_attn.dt_bias"
    edit_index(root, lambda wm: wm.pop(name))
    assert_convert_fails(root, tmp_path / "out", INDEX, name, "missing from the index")


def test_truncated_shard(release, tmp_path):
    root = release.path_copy
    path = root / shard_of_layer(3)
    path.write_bytes(path.read_bytes()[:-100])
    assert_convert_fails(root, tmp_path / "out", shard_of_layer(3), "truncated", LAYER.format(3))


def test_corrupted_header(release, tmp_path):
    root = release.path_copy
    path = root / shard_of_layer(1)
    data = bytearray(path.read_bytes())
    data[8:20] = b"\xff" * 12
    path.write_bytes(bytes(data))
    assert_convert_fails(root, tmp_path / "out", shard_of_layer(1), "corrupted safetensors header")


def test_wrong_shape(release, tmp_path):
    root = release.path_copy
    name = LAYER.format(0) + "self_attn.q_proj.weight"
    edit_shard(root, shard_of_layer(0), lambda t: t.__setitem__(name, torch.zeros(33, 64, dtype=torch.bfloat16)))
    assert_convert_fails(root, tmp_path / "out", shard_of_layer(0), name, "expected BF16 [32, 64]", "found BF16 [33, 64]")


def test_wrong_dtype(release, tmp_path):
    root = release.path_copy
    name = LAYER.format(1) + "self_attn.A_log"
    edit_shard(root, shard_of_layer(1), lambda t: t.__setitem__(name, t[name].to(torch.bfloat16)))
    assert_convert_fails(root, tmp_path / "out", shard_of_layer(1), name, "expected F32 [128]", "found BF16 [128]")


def test_mxfp4_packed_and_scale_shapes_that_do_not_match(release, tmp_path):
    root = release.path_copy
    base = LAYER.format(2) + "block_sparse_moe.experts.3.w1.weight_"
    edit_shard(root, shard_of_layer(2), lambda t: t.__setitem__(base + "scale", torch.zeros(32, 2, dtype=torch.uint8)))
    assert_convert_fails(root, tmp_path / "out", shard_of_layer(2), base + "packed", base + "scale",
                  "MXFP4 packed/scale shapes do not match", "[32, 1]", "[32, 2]")


def test_nonzero_a_log_padding(release, tmp_path):
    root = release.path_copy
    name = LAYER.format(4) + "self_attn.A_log"

    def poison(tensors):
        tensors[name][100] = 0.5

    edit_shard(root, shard_of_layer(4), poison)
    dst = tmp_path / "out"
    assert_convert_fails(root, dst, shard_of_layer(4), name, "padding must be zero", "entry 100", max_shard_size="60KB")


@pytest.mark.parametrize("bad", ["../evil.safetensors", "sub/model.safetensors", "..\\model.safetensors",
                                 "/abs/model.safetensors", "model-00001-of-000009.bin"])
def test_shard_names_outside_the_folder_are_refused(release, tmp_path, bad):
    root = release.path_copy
    name = LAYER.format(0) + "input_layernorm.weight"
    edit_index(root, lambda wm: wm.__setitem__(name, bad))
    assert_convert_fails(root, tmp_path / "out", INDEX, name, "refusing shard name", repr(bad))


def test_layers_the_config_does_not_have(release, tmp_path):
    root = release.path_copy
    name = LAYER.format(6) + "input_layernorm.weight"
    edit_shard(root, shard_of_layer(5), lambda t: t.__setitem__(name, torch.ones(64, dtype=torch.bfloat16)))
    edit_index(root, lambda wm: wm.__setitem__(name, shard_of_layer(5)))
    assert_convert_fails(root, tmp_path / "out", INDEX, name, "layer 6", "num_hidden_layers=6")


def test_experts_the_config_does_not_have(release, tmp_path):
    root = release.path_copy
    name = LAYER.format(1) + "block_sparse_moe.experts.4.w2.weight_scale"
    edit_index(root, lambda wm: wm.__setitem__(name, shard_of_layer(1)))
    assert_convert_fails(root, tmp_path / "out", INDEX, name, "num_experts=4")


def test_unknown_tensor_names_fail_unless_allowed(release, tmp_path):
    root = release.path_copy
    name = LAYER.format(0) + "self_attn.mystery.weight"
    edit_shard(root, shard_of_layer(0), lambda t: t.__setitem__(name, torch.ones(3, dtype=torch.bfloat16)))
    edit_index(root, lambda wm: wm.__setitem__(name, shard_of_layer(0)))
    assert_convert_fails(root, tmp_path / "out", INDEX, name, shard_of_layer(0), "--allow-unknown")
    summary = kc.convert(root, tmp_path / "allowed", allow_unknown=True, progress=False)
    weight_map = json.loads((tmp_path / "allowed" / INDEX).read_text())["weight_map"]
    assert name not in weight_map and not any("mystery" in n for n in weight_map)
    assert summary["provenance"]["skipped_unknown"] == [name]


def test_mixed_packed_and_plain_experts_in_one_layer(release, tmp_path):
    root = release.path_copy
    name = LAYER.format(3) + "block_sparse_moe.experts.0.w1.weight"
    edit_shard(root, shard_of_layer(3), lambda t: t.__setitem__(name, torch.ones(32, 32, dtype=torch.bfloat16)))
    edit_index(root, lambda wm: wm.__setitem__(name, shard_of_layer(3)))
    assert_convert_fails(root, tmp_path / "out", INDEX, "layer 3 mixes packed")


def test_cli_reports_the_error_and_returns_two(release, tmp_path, capsys):
    root = release.path_copy
    (root / shard_of_layer(5)).unlink()
    assert kc.run_convert([str(root), str(tmp_path / "out"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "kimik3 convert: error:" in err and shard_of_layer(5) in err
    assert kc.run_convert([str(root), str(tmp_path / "out2"), "--num-layers", "9"]) == 2
    assert "--num-layers 9: the source has 6 layers" in capsys.readouterr().err


def test_export_refuses_a_wrongly_shaped_tensor(release, tmp_path):
    converted = tmp_path / "converted"
    kc.convert(release.path_copy, converted, progress=False)
    shard = next(converted.glob("model-*.safetensors"))
    name = "language_model.model.layers.3.self_attn.kv_b_proj.weight"
    edit_shard(converted, shard.name, lambda t: t.__setitem__(name, torch.zeros(64, 31, dtype=torch.bfloat16)))
    with pytest.raises(ConversionError, match="expected shape") as info:
        kc.export(converted, tmp_path / "exported", progress=False)
    assert name in str(info.value) and shard.name in str(info.value)
    assert not (tmp_path / "exported" / "config.json").exists()
