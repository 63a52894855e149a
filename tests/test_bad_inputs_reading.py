"""Bad input on the converter's reading side: every way a shard can break the safetensors format, non-finite values,
A_log padding, the exported folder, and verify's independent reader. Each case names its input in its id; the table
in docs/bad_inputs.md ("Reading and values") lists the same ids."""

import json
import os
import shutil
import struct
import threading
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import kimik3.convert as kc
import kimik3.modeling
from kimik3.convert import safetensors_io as sio, testing
from kimik3.convert.errors import ConversionError

HEADS = 2
L0 = "language_model.model.layers.0."
Q, K = L0 + "self_attn.q_proj.weight", L0 + "self_attn.k_proj.weight"
A_LOG, DT_BIAS = L0 + "self_attn.A_log", L0 + "self_attn.dt_bias"
EXPERT = "language_model.model.layers.1.block_sparse_moe.experts.1.w2.weight_"
SHARD0, SHARD1 = "model-00001-of-000003.safetensors", "model-00002-of-000003.safetensors"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """2 layers (KDA + dense MLP, MLA + MoE with 2 MXFP4 experts), no vision: 3 shards, ~270 kB."""
    return testing.write_release_checkpoint(tmp_path_factory.mktemp("release") / "k3", seed=7, num_layers=2,
                                            num_experts=2, vision=False, return_dense=False).path


@pytest.fixture(scope="module")
def converted(pristine, tmp_path_factory):
    dst = tmp_path_factory.mktemp("converted") / "out"
    kc.convert(pristine, dst, progress=False)
    return dst


@pytest.fixture
def release(pristine, tmp_path):
    shutil.copytree(pristine, tmp_path / "k3")
    return tmp_path / "k3"


# ------------------------------------------------------------------------------------------------------------------
# Raw shard editing


def split_shard(path):
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + length]), data[8 + length:]


def join_shard(path, header, body: bytes, length: int | None = None) -> None:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + body)


def edit_header(change):
    def damage(path):
        header, body = split_shard(path)
        change(header)
        join_shard(path, header, body)
    return damage


def replace_header_text(old: str, new: str):
    def damage(path):
        header, body = split_shard(path)
        text = json.dumps(header)
        assert old in text
        join_shard(path, text.replace(old, new, 1).encode(), body)
    return damage


def set_entry(name, key, value):
    return edit_header(lambda h: h[name].__setitem__(key, value))


def raw_bytes(change):
    def damage(path):
        path.write_bytes(change(path.read_bytes()))
    return damage


def header_length(value):
    return raw_bytes(lambda b: struct.pack("<Q", value) + b[8:])


def hole_after_first_tensor(path):
    header, body = split_shard(path)
    first_end = min(e["data_offsets"][1] for k, e in header.items() if k != "__metadata__")
    for key, entry in header.items():
        if key != "__metadata__" and entry["data_offsets"][0] >= first_end:
            entry["data_offsets"] = [o + 8 for o in entry["data_offsets"]]
    join_shard(path, header, body[:first_end] + bytes(8) + body[first_end:])


def k_proj_reads_q_proj_bytes(header):
    header[K]["data_offsets"] = list(header[Q]["data_offsets"])


def swap(name):
    return edit_header(lambda h: h[name].__setitem__("data_offsets", h[name]["data_offsets"][::-1]))


# (damage to shard 0, message fragments, tensor named in the message or None, the safetensors library refuses it too)
HEADER_CASES = [
    pytest.param(raw_bytes(lambda b: b""), ["not even the 8-byte header length"], None, True, id="empty-file"),
    pytest.param(lambda p: header_length(p.stat().st_size)(p), ["truncated or corrupted safetensors header",
                 "beyond the end"], None, True, id="header-len-beyond-file"),
    pytest.param(header_length(2**63), ["100 MB limit"], None, True, id="header-len-absurd"),
    pytest.param(lambda p: join_shard(p, b"{nonsense", split_shard(p)[1]), ["not JSON"], None, True,
                 id="header-not-json"),
    pytest.param(lambda p: join_shard(p, b'{"\xff\xfe": 1}', split_shard(p)[1]), ["not UTF-8"], None, True,
                 id="header-not-utf8"),
    pytest.param(lambda p: join_shard(p, b"[1, 2]", split_shard(p)[1]), ["not a JSON object"], None, True,
                 id="header-not-object"),
    pytest.param(replace_header_text('"shape": [32, 64]', '"shape": [NaN, 64]'), ["not JSON", "NaN"], None, True,
                 id="header-nan-literal"),
    pytest.param(replace_header_text(f'"{K}"', f'"{Q}"'), ["appears twice"], Q, True, id="dup-key"),
    pytest.param(edit_header(k_proj_reads_q_proj_bytes), ["overlaps"], None, True, id="overlap-offsets"),
    pytest.param(swap(Q), ["end before they begin"], Q, True, id="out-of-order-offsets"),
    pytest.param(hole_after_first_tensor, ["belong to no tensor", "no holes"], None, True, id="hole-in-buffer"),
    pytest.param(raw_bytes(lambda b: b + bytes(16)), ["last 16 bytes", "no trailing data"], None, True,
                 id="trailing-bytes"),
    pytest.param(raw_bytes(lambda b: b[:-100]), ["file is truncated"], None, True, id="truncated-file"),
    pytest.param(set_entry(Q, "dtype", "BF17"), ["unknown dtype 'BF17'"], Q, True, id="unknown-dtype"),
    pytest.param(set_entry(Q, "shape", [33, 64]), ["span 4096 bytes", "needs 4224"], Q, True, id="span-mismatch"),
    pytest.param(set_entry(Q, "shape", [-32, -64]), ["bad shape [-32, -64]"], Q, True, id="negative-shape"),
    pytest.param(set_entry(Q, "shape", [32.0, 64]), ["bad shape [32.0, 64]"], Q, True, id="float-shape"),
    pytest.param(set_entry(Q, "data_offsets", [-2, 4094]), ["bad data_offsets [-2, 4094]"], Q, True,
                 id="negative-offset"),
    pytest.param(edit_header(lambda h: h[Q].__setitem__("data_offsets", [float(o) for o in h[Q]["data_offsets"]])),
                 ["bad data_offsets"], Q, True, id="float-offset"),
    pytest.param(edit_header(lambda h: h.__setitem__("__metadata__", {"format": 1})),
                 ["__metadata__ must map strings to strings"], None, True, id="metadata-non-string"),
    pytest.param(edit_header(lambda h: h.__setitem__("__metadata__", ["pt"])),
                 ["__metadata__ must map strings to strings"], None, True, id="metadata-not-object"),
    pytest.param(edit_header(lambda h: h[Q].pop("dtype")), ["needs exactly dtype, shape and data_offsets"], Q, True,
                 id="entry-missing-key"),
    # the library ignores unknown keys; an entry we do not understand is refused here
    pytest.param(set_entry(Q, "scale", 2.0), ["needs exactly dtype, shape and data_offsets"], Q, False,
                 id="entry-extra-key"),
]


def assert_refused(src, dst, fragments, tensor=None, **options):
    with pytest.raises(ConversionError) as info:
        kc.convert(src, dst, progress=False, **options)
    message = str(info.value)
    for fragment in fragments + ([f"`{tensor}`"] if tensor else []):
        assert fragment in message, message
    assert not (dst / "config.json").exists() and not (dst / "model.safetensors.index.json").exists()
    return message


@pytest.mark.parametrize("damage, fragments, tensor, library_refuses", HEADER_CASES)
def test_a_shard_that_breaks_the_format_is_refused_naming_file_and_tensor(release, tmp_path, damage, fragments,
                                                                          tensor, library_refuses):
    shard = release / SHARD0
    damage(shard)
    message = assert_refused(release, tmp_path / "out", fragments, tensor)
    assert str(shard) in message
    if library_refuses:  # the same file is invalid by the format's reference implementation
        with pytest.raises(Exception):
            with safe_open(str(shard), "pt") as handle:
                for name in handle.keys():
                    handle.get_tensor(name)


def make_fifo(path):
    path.unlink()
    os.mkfifo(path)


def make_directory(path):
    path.unlink()
    path.mkdir()


def make_dangling_symlink(path):
    path.unlink()
    path.symlink_to(path.with_name("gone.safetensors"))


@pytest.mark.parametrize("make, fragment", [
    pytest.param(make_directory, "is a directory", id="shard-is-directory"),
    pytest.param(make_fifo, "is a FIFO", id="shard-is-fifo"),
    pytest.param(make_dangling_symlink, "missing", id="shard-dangling-symlink"),
])
def test_something_other_than_a_file_where_a_shard_should_be(release, tmp_path, make, fragment):
    shard = release / SHARD1
    make(shard)
    outcome = {}

    def run():
        try:
            kc.convert(release, tmp_path / "out", progress=False)
        except ConversionError as exc:
            outcome["error"] = str(exc)

    worker = threading.Thread(target=run, daemon=True)  # a FIFO opened for reading blocks until a writer comes
    worker.start()
    worker.join(30)
    assert not worker.is_alive(), "convert hangs on the shard"
    assert fragment in outcome["error"] and str(shard) in outcome["error"]


@pytest.mark.parametrize("error", [pytest.param(PermissionError(13, "Permission denied"), id="shard-unreadable")])
def test_an_unreadable_shard_names_the_path(release, tmp_path, monkeypatch, error):
    # the tests run as root, where chmod 000 does not stop a read; refuse the open itself for this one path
    shard, real_open = release / SHARD1, os.open

    def guarded_open(path, *args, **kwargs):
        if os.fspath(path) == str(shard):
            raise error
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", guarded_open)
    assert_refused(release, tmp_path / "out", [str(shard), "cannot be opened for reading", "Permission denied"])


def q_also_in_shard1(root):
    """`q_proj` (shard 0 by the index) also in shard 1's header, with other values."""
    tensors = load_file(str(root / SHARD1))
    tensors[Q] = -load_file(str(root / SHARD0))[Q]
    save_file(tensors, str(root / SHARD1), metadata={"format": "pt"})


def unlisted_tensor_in_shard0(root):
    tensors = load_file(str(root / SHARD0))
    tensors[L0 + "self_attn.extra.weight"] = torch.ones(4, dtype=torch.bfloat16)
    save_file(tensors, str(root / SHARD0), metadata={"format": "pt"})


def nested_header(root):
    header, body = split_shard(root / SHARD0)
    join_shard(root / SHARD0, ('{"x": ' + "[" * 100_000 + "]" * 100_000 + "}").encode(), body)


def shard1_linked_out(root):
    outside = root.parent / "elsewhere.safetensors"
    shutil.move(root / SHARD1, outside)
    (root / SHARD1).symlink_to(outside)


@pytest.mark.parametrize("damage, fragments", [
    pytest.param(q_also_in_shard1, [f"{SHARD1}, tensor `{Q}`", "also in", f"/{SHARD0}, which the index",
                                    "must come from one shard"],
                 id="tensor-in-two-shards"),
    pytest.param(unlisted_tensor_in_shard0, [f"{SHARD0}, tensor `{L0}self_attn.extra.weight`",
                                                "missing from the index"],
                 id="tensor-not-in-index"),
    pytest.param(nested_header, [SHARD0, "corrupted safetensors header: nested too deeply"], id="header-deeply-nested"),
    pytest.param(shard1_linked_out, [f"{SHARD1}: is a symlink to", "elsewhere.safetensors, outside the folder"],
                 id="shard-symlink-out"),
])
def test_a_tensor_from_two_places_or_a_shard_from_outside_is_refused(release, tmp_path, damage, fragments):
    """Each of these converted silently before (the second copy, the unlisted tensor and the link were never looked
    at; the nested header was a RecursionError traceback)."""
    damage(release)
    assert_refused(release, tmp_path / "out", fragments)


# ------------------------------------------------------------------------------------------------------------------
# Non-finite values


def poke(shard, name, index, value):
    def damage(root):
        tensors = load_file(str(root / shard))
        tensors[name][index] = value
        save_file(tensors, str(root / shard), metadata={"format": "pt"})
    return damage


NAN, INF = float("nan"), float("inf")
VALUE_CASES = [
    pytest.param(poke(SHARD0, Q, (3, 5), NAN), {}, Q, ["non-finite value nan at [3, 5]", "BF16 [32, 64]"],
                 id="nan-in-bf16"),
    pytest.param(poke(SHARD0, Q, (0, 0), INF), {}, Q, ["non-finite value inf at [0, 0]"], id="inf-in-bf16"),
    pytest.param(poke(SHARD0, DT_BIAS, (31,), -INF), {}, DT_BIAS, ["non-finite value -inf at [31]"],
                 id="neg-inf-in-f32"),
    pytest.param(poke(SHARD0, A_LOG, (1,), NAN), {}, A_LOG, ["non-finite value nan at [1]"], id="nan-in-a-log"),
    # chunks of 1000 bytes: the NaN is in the fifth chunk of the tensor, its index counted across chunks
    pytest.param(poke(SHARD0, Q, (31, 63), NAN), {"chunk_bytes": 1000}, Q, ["non-finite value nan at [31, 63]"],
                 id="nan-in-last-chunk"),
    pytest.param(poke(SHARD1, EXPERT + "scale", (5, 0), 0xFF), {}, EXPERT + "scale",
                 ["E8M0 scale byte 0xFF", "at [5, 0]"], id="e8m0-0xff"),
    pytest.param(poke(SHARD1, EXPERT + "scale", (31, 0), 0xFF), {"experts_format": "mxfp4"}, EXPERT + "scale",
                 ["E8M0 scale byte 0xFF", "at [31, 0]"], id="e8m0-0xff-kept-packed"),
]


@pytest.mark.parametrize("damage, options, tensor, fragments", VALUE_CASES)
def test_non_finite_source_values_are_refused(release, tmp_path, damage, options, tensor, fragments):
    damage(release)
    assert_refused(release, tmp_path / "out", fragments, tensor, **options)


def test_chunked_value_check_agrees_with_isfinite_everywhere():
    entry = sio.TensorEntry("w", "BF16", (4, 6), 0, 48)
    for flat in range(24):
        values = torch.ones(24, dtype=torch.bfloat16)
        values[flat] = NAN
        raw = values.view(torch.uint8)
        for start in range(0, 48, 7):  # 7-byte chunks cut elements in half
            chunk = raw[start:start + 7]
            inside = start <= 2 * flat and 2 * flat + 2 <= start + 7
            if inside:
                with pytest.raises(ConversionError, match=rf"at \[{flat // 6}, {flat % 6}\]"):
                    sio.check_values("x.safetensors", entry, chunk, start)
            else:
                sio.check_values("x.safetensors", entry, chunk, start)


def copy_folder(src, dst):
    shutil.copytree(src, dst)
    return dst


def poke_converted(name, index, value):
    def damage(folder):
        shard = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"][name]
        poke(shard, name, index, value)(folder)
    return damage


EXPORT_CASES = [
    pytest.param(poke_converted(Q, (1, 2), NAN), Q, ["non-finite value nan at [1, 2]"], id="export-nan-weight"),
    pytest.param(poke_converted("language_model.model.layers.1.mlp.experts.gate_up_proj", (1, 40, 3), INF),
                 "language_model.model.layers.1.mlp.experts.gate_up_proj", ["non-finite value inf at [1, 40, 3]"],
                 id="export-inf-expert"),
]


@pytest.mark.parametrize("damage, tensor, fragments", EXPORT_CASES)
def test_export_refuses_non_finite_weights(converted, tmp_path, damage, tensor, fragments, capsys):
    tuned = copy_folder(converted, tmp_path / "tuned")
    damage(tuned)
    assert kc.run_export([str(tuned), str(tmp_path / "exported"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kimik3 export: error:") and f"`{tensor}`" in err
    assert all(f in err for f in fragments), err
    assert not (tmp_path / "exported" / "config.json").exists()


@pytest.mark.parametrize("case", [pytest.param("e8m0-0xff", id="export-e8m0-0xff-packed")])
def test_export_refuses_a_nan_scale_in_kept_packed_experts(release, tmp_path, case):
    packed = tmp_path / "packed"
    kc.convert(release, packed, experts_format="mxfp4", progress=False)
    name = "language_model.model.layers.1.mlp.experts.down_proj_scale"
    poke_converted(name, (1, 7, 0), 0xFF)(packed)
    with pytest.raises(ConversionError, match=r"E8M0 scale byte 0xFF .*at \[1, 7, 0\]"):
        kc.export(packed, tmp_path / "exported", progress=False)


# ------------------------------------------------------------------------------------------------------------------
# A_log padding


def a_log_of_length(length, tail=0.0):
    def damage(root):
        tensors = load_file(str(root / SHARD0))
        values = torch.full((length,), tail, dtype=torch.float32)
        kept = min(HEADS, length)
        values[:kept] = tensors[A_LOG][:kept]
        tensors[A_LOG] = values
        save_file(tensors, str(root / SHARD0), metadata={"format": "pt"})
    return damage


@pytest.mark.parametrize("length", [
    pytest.param(2, id="a-log-unpadded-2-of-2"),
    pytest.param(100, id="a-log-pad-2-of-100"),
    pytest.param(256, id="a-log-pad-2-of-256"),
])
def test_a_log_of_any_zero_padded_length_converts_and_export_restores_it(release, tmp_path, length):
    a_log_of_length(length)(release)
    summary = kc.convert(release, tmp_path / "out", progress=False)
    assert summary["provenance"]["release_a_log_length"] == length
    ours = load_file(str(next((tmp_path / "out").glob("model-*.safetensors"))))[A_LOG]
    assert ours.shape == (HEADS,)
    kc.export(tmp_path / "out", tmp_path / "exported", progress=False)
    exported = load_file(str(tmp_path / "exported" / SHARD0))[A_LOG]
    original = load_file(str(release / SHARD0))[A_LOG]
    assert exported.shape == (length,) and torch.equal(exported.view(torch.int32), original.view(torch.int32))


@pytest.mark.parametrize("damage, fragments", [
    pytest.param(a_log_of_length(1), ["expected F32 [128]", "any length >= 2 heads", "found F32 [1]"],
                 id="a-log-shorter-than-heads"),
    pytest.param(poke(SHARD0, A_LOG, (50,), 0.5), ["padding must be zero", "entry 50 is 0.5"],
                 id="a-log-nonzero-tail"),
    pytest.param(a_log_of_length(100, tail=-0.0), ["padding must be zero", "entry 2 is -0.0"],
                 id="a-log-negative-zero-tail"),
    pytest.param(lambda root: set_entry(A_LOG, "shape", [1, 128])(root / SHARD0), ["found F32 [1, 128]"],
                 id="a-log-2d"),
])
def test_a_log_that_is_not_heads_plus_zero_padding_is_refused(release, tmp_path, damage, fragments):
    damage(release)
    assert_refused(release, tmp_path / "out", fragments + [str(release / SHARD0)], A_LOG)


@pytest.mark.parametrize("recorded", [pytest.param(None, id="export-a-log-no-record")])
def test_export_without_a_recorded_length_pads_like_the_release_and_says_so(converted, tmp_path, recorded):
    folder = copy_folder(converted, tmp_path / "trained")
    provenance = json.loads((folder / "kimik3_conversion.json").read_text())
    provenance.pop("release_a_log_length")
    (folder / "kimik3_conversion.json").write_text(json.dumps(provenance))
    summary = kc.export(folder, tmp_path / "exported", progress=False)
    assert load_file(str(tmp_path / "exported" / SHARD0))[A_LOG].shape == (128,)
    assert any("A_log padded to 128" in note and "records no source length" in note for note in summary["notes"])


# ------------------------------------------------------------------------------------------------------------------
# The exported folder, MXFP4 bytes versus values, verify's reader


@pytest.mark.parametrize("case", [pytest.param("no-code", id="export-carries-no-code")])
def test_exported_folder_carries_no_model_code_and_says_how_to_load(converted, tmp_path, capsys, case):
    assert kc.run_export([str(converted), str(tmp_path / "exported"), "--quiet"]) == 0
    out = capsys.readouterr().out
    exported = tmp_path / "exported"
    ours = {p.name for p in Path(kimik3.modeling.__file__).parent.glob("*.py")}
    assert not ours & {p.name for p in exported.iterdir()}
    config = json.loads((exported / "config.json").read_text())
    for target in list(config["auto_map"].values()) + list(config["text_config"]["auto_map"].values()):
        assert not (exported / (target.split(".")[0] + ".py")).exists()  # it names only files that are not here
    for text in (out, (exported / "README.md").read_text(), (exported / "kimik3_export.json").read_text()):
        assert "kimik3 convert" in text and "carries no model code" in text
    # the release's tokenizer code still comes along (tokenizer_config.json's auto_map names it)
    assert (exported / "tokenization_kimi.py").exists()


@pytest.mark.parametrize("case", [pytest.param("max-code-3", id="mxfp4-other-scale")])
def test_verify_reports_bytes_equal_and_values_equal_experts_apart(release, tmp_path, capsys, case):
    # group 0 of row 0 of one expert: every code is 3.0 (0x55: both nibbles code 5) at scale s; the OCP rule
    # re-encodes the same values as 6.0 at scale s - 1
    name = EXPERT + "packed"
    tensors = load_file(str(release / SHARD1))
    tensors[name][0, :16] = 0x55
    save_file(tensors, str(release / SHARD1), metadata={"format": "pt"})
    kc.convert(release, tmp_path / "out", progress=False)
    summary = kc.export(tmp_path / "out", tmp_path / "exported", progress=False)
    assert any("re-quantised with the OCP scale rule" in note for note in summary["notes"])
    before, after = load_file(str(release / SHARD1)), load_file(str(tmp_path / "exported" / SHARD1))
    assert not torch.equal(before[name], after[name])
    assert int(after[EXPERT + "scale"][0, 0]) == int(before[EXPERT + "scale"][0, 0]) - 1
    assert kc.run_verify([str(release), str(tmp_path / "exported")]) == 0
    out = capsys.readouterr().out
    total = len(json.loads((release / "model.safetensors.index.json").read_text())["weight_map"])
    assert f"{total} compared, 0 mismatch" in out and f"{total - 2} bytes-equal, 2 values-equal" in out
    # a real difference in the values is still a mismatch
    tensors = load_file(str(tmp_path / "exported" / SHARD1))
    tensors[name][0, 0] ^= 0x01
    save_file(tensors, str(tmp_path / "exported" / SHARD1), metadata={"format": "pt"})
    assert kc.run_verify([str(release), str(tmp_path / "exported")]) == 1
    assert f"MISMATCH {name}" in capsys.readouterr().out


@pytest.mark.parametrize("case", [pytest.param("k-reads-q", id="verify-reads-source-independently")])
def test_verify_catches_a_reader_that_misreads_the_source(release, tmp_path, monkeypatch, capsys, case):
    """If our header reader gave `k_proj` the bytes of `q_proj` (what a last-wins duplicate key did), convert would
    copy the wrong values and a verify reading the source the same way would agree; it reads with the library."""
    real = sio.read_header

    def misread(path):
        entries, metadata = real(path)
        if str(path).endswith(SHARD0):
            entries[K] = sio.TensorEntry(K, entries[Q].dtype, entries[Q].shape, entries[Q].begin, entries[Q].end)
        return entries, metadata

    monkeypatch.setattr(sio, "read_header", misread)
    kc.convert(release, tmp_path / "out", progress=False)
    assert kc.run_verify([str(release), str(tmp_path / "out"), "--logits", "never"]) == 1
    out = capsys.readouterr().out
    assert f"MISMATCH {K}" in out and "1 mismatch" in out


@pytest.mark.parametrize("case", [pytest.param("dup-key", id="cli-header-error-exit-2")])
def test_cli_gives_exit_code_two_and_names_the_shard(release, tmp_path, capsys, case):
    replace_header_text(f'"{K}"', f'"{Q}"')(release / SHARD0)
    assert kc.run_convert([str(release), str(tmp_path / "out"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kimik3 convert: error:") and SHARD0 in err and "appears twice" in err


@pytest.mark.parametrize("tokens", [pytest.param(600, id="verify-many-tokens-vision")])
def test_verify_of_a_vision_checkpoint_draws_no_reserved_ids(tmp_path, capsys, tokens):
    """verify's own input ids: ordinary tokens only. Spread over the whole vocabulary they reached the reserved
    specials' `<|media_pad|>`, which a model with a vision tower refuses without an image."""
    release = testing.write_release_checkpoint(tmp_path / "k3", seed=3, num_layers=2, num_experts=2, vision=True,
                                               return_dense=False).path
    kc.convert(release, tmp_path / "out", progress=False)
    assert kc.run_verify([str(release), str(tmp_path / "out"), "--logits", "always", "--tokens", str(tokens)]) == 0
    out = capsys.readouterr().out
    assert "logits: equal" in out, out
    from kimik3.convert.verifier import _fixed_input
    from kimik3.modeling.tokenization_kimi_k3 import NUM_RESERVED_SPECIAL

    vocab = json.loads((tmp_path / "out" / "config.json").read_text())["text_config"]["vocab_size"]
    ids = _fixed_input(vocab, tokens)
    assert int(ids.max()) < vocab - NUM_RESERVED_SPECIAL and len(set(ids[0].tolist())) > tokens // 2


def _nudged(folder):
    """A fine-tune's stand-in: every floating tensor but A_log moved by noise (dense experts no MXFP4 grid holds)."""
    generator = torch.Generator().manual_seed(1)
    for shard in sorted(folder.glob("*.safetensors")):
        tensors = load_file(str(shard))
        tensors = {name: value + (0.01 * torch.randn(value.shape, generator=generator)).to(value.dtype)
                   if value.is_floating_point() and "A_log" not in name else value for name, value in tensors.items()}
        save_file(tensors, str(shard), metadata={"format": "pt"})


@pytest.mark.parametrize("damage", [
    pytest.param(None, id="verify-finetune-against-its-export"),
    pytest.param("expert", id="verify-finetune-export-expert-changed"),
    pytest.param("norm", id="verify-finetune-export-norm-changed"),
])
def test_verify_knows_an_export_that_requantised_the_experts(converted, tmp_path, capsys, damage):
    """A fine-tune (our layout, dense experts) against its export (the release layout, experts re-quantised to MXFP4):
    the experts are compared after the export's own MXFP4 round trip of the dense side, said so with the error, and the
    logits likewise; a real difference, in an expert or elsewhere, is still a mismatch."""
    finetune = tmp_path / "finetune"
    shutil.copytree(converted, finetune)
    _nudged(finetune)
    kc.export(finetune, tmp_path / "exported", progress=False)
    if damage is not None:
        index = json.loads((tmp_path / "exported" / "model.safetensors.index.json").read_text())["weight_map"]
        name = next(n for n in index if (n.endswith("weight_packed") if damage == "expert" else
                                         n.endswith("post_attention_layernorm.weight")))
        shard = tmp_path / "exported" / index[name]
        tensors = load_file(str(shard))
        if damage == "expert":
            tensors[name][0, 0] ^= 0x11  # two codes of one group
        else:
            tensors[name][0] += 1.0
        save_file(tensors, str(shard), metadata={"format": "pt"})
    code = kc.run_verify([str(finetune), str(tmp_path / "exported"), "--logits", "always"])
    out = capsys.readouterr().out
    assert "differ only by the export's MXFP4 re-quantisation (relative RMS error " in out, out
    if damage is None:
        assert code == 0 and "0 mismatch(es)" in out
        assert "logits: equal (the dense experts through the export's MXFP4 round trip) (max |diff| 0.0)" in out
    else:
        assert code == 1 and (f"MISMATCH {name.replace('weight_packed', 'weight')}" in out or f"MISMATCH {name}" in out)
        assert "logits: DIFFERENT" in out
