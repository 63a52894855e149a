"""from_pretrained straight from the release layout (modeling_kimik3/release_layout_kimi_k3.py): equal logits and equal
tensors to the `kimik3 convert` path (both expert formats; composite, remote-code and text-only folders), what
save_pretrained writes, release-named errors for bad inputs, the name rules agreeing with kimik3/name_map.py on all
60 release patterns, and peak memory while loading."""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import kimik3.convert as kc
from k3_test_utils import run_forked
from kimik3.configuration import released_config_dict
from kimik3 import name_map as nm
from kimik3.convert import testing
from kimik3.modeling.configuration_kimi_k3 import KimiK3Config
from kimik3.modeling.release_layout_kimi_k3 import release_conversions
from kimik3.modeling.files_kimi_k3 import KimiK3LoadError
from kimik3.modeling.modeling_kimi_k3 import KimiK3ForCausalLM
from kimik3.modeling.multimodal_kimi_k3 import KimiK3ForConditionalGeneration
from kimik3.modeling.saving_kimi_k3 import COMPOSITE_AUTO_MAP, TEXT_AUTO_MAP
from kimik3.remote_code import remote_code_files

transformers = pytest.importorskip("transformers")
FORMATS = ("dense", "mxfp4")
PATTERNS = Path(__file__).resolve().parents[1] / "configuration" / "kimi_k3_tensor_patterns.json"


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    return testing.write_release_checkpoint(tmp_path_factory.mktemp("release") / "k3", seed=3, num_layers=6,
                                            num_experts=8)


@pytest.fixture(scope="module")
def converted(release, tmp_path_factory):
    root = tmp_path_factory.mktemp("converted")
    out = {}
    for fmt in FORMATS:
        out[fmt] = root / fmt
        kc.convert(release.path, out[fmt], progress=False, experts_format=fmt)
    out["text"] = root / "text"
    kc.convert(release.path, out["text"], progress=False, text_only=True)
    return out


def _with_code(src: Path, dst: Path, config: dict, auto_map: dict) -> Path:
    """A copy of a release folder holding our code files and an auto_map naming them (the Hub-repo case)."""
    shutil.copytree(src, dst)
    for path in remote_code_files():
        shutil.copy2(path, dst / path.name)
    (dst / "config.json").write_text(json.dumps(dict(config, auto_map=auto_map), indent=2))
    return dst


@pytest.fixture(scope="module")
def remote_folder(release, tmp_path_factory):
    return _with_code(release.path, tmp_path_factory.mktemp("remote") / "k3", release.config, COMPOSITE_AUTO_MAP)


@pytest.fixture(scope="module")
def text_folder(release, tmp_path_factory):
    """The text-only release layout (Kimi-Linear style): the release's text_config at the root, tensor names without
    `language_model.`, no vision tensors."""
    dst = tmp_path_factory.mktemp("text") / "k3"
    dst.mkdir()
    index = json.loads((release.path / "model.safetensors.index.json").read_text())
    weight_map = {}
    for shard in sorted(set(index["weight_map"].values())):
        tensors = {k.removeprefix("language_model."): v for k, v in load_file(release.path / shard).items()
                   if k.startswith("language_model.")}
        if tensors:
            save_file(tensors, dst / shard, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(tensors, shard))
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for path in remote_code_files():
        shutil.copy2(path, dst / path.name)
    text = dict(release.config["text_config"], auto_map=TEXT_AUTO_MAP)
    (dst / "config.json").write_text(json.dumps(text, indent=2))
    return dst


def logits(model):
    ids = (torch.arange(12).unsqueeze(0) * 37 + 5) % 256
    with torch.no_grad():
        return model(input_ids=ids).logits


def assert_same_tensors(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sorted(sa) == sorted(sb)
    for name in sa:
        assert sa[name].dtype == sb[name].dtype and torch.equal(sa[name], sb[name]), name


@pytest.mark.parametrize("fmt", FORMATS)
def test_composite_release_equals_convert_path(release, converted, fmt):
    direct = KimiK3ForConditionalGeneration.from_pretrained(release.path, experts_format=fmt, dtype=torch.bfloat16)
    via_convert = KimiK3ForConditionalGeneration.from_pretrained(converted[fmt], dtype=torch.bfloat16)
    assert direct.config.text_config.experts_format == fmt
    assert_same_tensors(direct, via_convert)
    layer = direct.language_model.model.layers[0]
    # F32 islands stay F32 in a bf16 load; A_log un-padded from 128 to the 2 heads
    assert layer.self_attn.A_log.dtype == torch.float32 and layer.self_attn.A_log.shape == (2,)
    assert torch.equal(layer.self_attn.A_log, release.dense["language_model.model.layers.0.self_attn.A_log"][:2])
    assert torch.equal(logits(direct.eval()), logits(via_convert.eval()))


def test_remote_code_folder_loads_the_release_tensors(remote_folder, converted):
    auto = transformers.AutoModelForCausalLM
    direct = auto.from_pretrained(str(remote_folder), trust_remote_code=True, experts_format="mxfp4",
                                  dtype=torch.bfloat16)
    assert type(direct).__module__.startswith("transformers_modules")  # the copied code, not the installed package
    via_convert = auto.from_pretrained(str(converted["mxfp4"]), trust_remote_code=True, dtype=torch.bfloat16)
    assert_same_tensors(direct, via_convert)
    assert torch.equal(logits(direct.eval()), logits(via_convert.eval()))


REGISTRIES = r"""
import json, sys
import transformers.conversion_mapping as mapping
from transformers import AutoModelForCausalLM
from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES
from transformers.dynamic_module_utils import get_class_from_dynamic_module

folder = sys.argv[1]
CLASSES = ("KimiK3ForCausalLM", "KimiK3TextBackbone")


def registries():
    # the objects themselves (compared with `is`): a registration replaces them even when the contents are equal
    cache = mapping._checkpoint_conversion_mapping_cache or {}
    return ({name: cache.get(name) for name in CLASSES}, set(mapping.USER_REGISTERED_MAPPINGS),
            dict(ALL_PARALLEL_STYLES.items()))


def unchanged(a, b, style):
    # transformers' own modules, imported lazily by the model code, may add styles of theirs: entries present
    # before must be the same objects, and nothing of ours may have appeared
    return all(a[0][n] is b[0][n] for n in CLASSES) and a[1] == b[1] and style not in b[2] \
        and all(b[2].get(k) is a[2][k] for k in a[2])


before = registries()
with open(folder + "/config.json") as config:
    model_class = get_class_from_dynamic_module(json.load(config)["auto_map"]["AutoModelForCausalLM"], folder)
imported = registries()
parallel = sys.modules[model_class.__module__.rsplit(".", 1)[0] + ".parallel_kimi_k3"]
model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
loaded = registries()
parallel.register_shard_styles()
style = ALL_PARALLEL_STYLES[parallel.HEAD_SHARD_STYLE]
parallel.register_shard_styles()
print(json.dumps({
    "module": model_class.__module__,
    "import_changed_nothing": unchanged(before, imported, parallel.HEAD_SHARD_STYLE),
    "load_registered": [loaded[0][n] is not None and loaded[0][n] is not imported[0][n] for n in CLASSES],
    "user_registered": sorted(set(CLASSES) & loaded[1]),
    "load_left_tp_styles": parallel.HEAD_SHARD_STYLE not in loaded[2]
                           and all(loaded[2].get(k) is v for k, v in imported[2].items()),
    "style_registered_once": ALL_PARALLEL_STYLES[parallel.HEAD_SHARD_STYLE] is style,
}))
"""


def test_importing_the_remote_code_registers_nothing_until_a_load_asks(remote_folder, fresh_python):
    """Importing the code of a folder (a fresh process, the package never imported) leaves transformers' conversion
    mapping and its tensor-parallel styles as they were; the first from_pretrained registers the release conversions
    it needs (a release-layout folder: the load fails without them), and the head-shard style enters the styles only
    when asked (a load with a TP plan; here by hand), once."""
    returncode, stdout, error = fresh_python(REGISTRIES, str(remote_folder))
    assert returncode == 0, error
    result = json.loads(stdout.strip().splitlines()[-1])
    assert result["module"].startswith("transformers_modules.")
    assert result["import_changed_nothing"]
    assert result["load_registered"] == [True, True]
    assert result["user_registered"] == ["KimiK3ForCausalLM", "KimiK3TextBackbone"]
    assert result["load_left_tp_styles"] and result["style_registered_once"]


def test_text_only_release_folder(text_folder, converted):
    direct = transformers.AutoModelForCausalLM.from_pretrained(str(text_folder), trust_remote_code=True,
                                                               dtype=torch.bfloat16)
    via_convert = KimiK3ForCausalLM.from_pretrained(converted["text"], dtype=torch.bfloat16)
    assert_same_tensors(direct, via_convert)
    assert torch.equal(logits(direct.eval()), logits(via_convert.eval()))


# ----------------------------------------------------------------------------------------------------------------
# save_pretrained


def _split_squeezes_all_dims() -> bool:
    from transformers.core_model_loading import SplitModulelist

    out = SplitModulelist(0).convert({"a.*.w": torch.zeros(2, 3, 1)}, ["a.*.w"], ["a.*.w"])
    return next(iter(out.values())).shape == (3,)


def _saved_tensors(path: Path) -> dict:
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, "pt") as handle:
            out.update({k: handle.get_tensor(k) for k in handle.keys()})
    return out


@pytest.mark.parametrize("fmt", FORMATS)
def test_save_pretrained_writes_the_release_layout_back(release, tmp_path, fmt):
    model = KimiK3ForConditionalGeneration.from_pretrained(release.path, experts_format=fmt, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "saved")
    saved = _saved_tensors(tmp_path / "saved")
    source = _saved_tensors(release.path)
    # every tensor of the release (text, vision tower and projector), with its dtype and value, bit for bit
    # (kept-packed experts are the same bytes; dequantised experts re-quantise to the same bytes as they were not
    # changed)
    assert sorted(saved) == sorted(source)
    for name, value in source.items():
        written = saved[name]
        if written.shape != value.shape:
            # transformers 5.17's SplitModulelist squeezes every size-1 dim: the tiny fixture's [rows, 1] MXFP4
            # scales come back as [rows] (the real K3 scales are [rows, 112] / [rows, 96], not affected)
            assert _split_squeezes_all_dims() and written.shape == value.squeeze().shape, name
            written = written.reshape(value.shape)
        assert written.dtype == value.dtype and torch.equal(written.view(torch.uint8), value.view(torch.uint8)), name
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert config["text_config"]["quantization_config"]["format"] == "mxfp4-pack-quantized"
    again = KimiK3ForConditionalGeneration.from_pretrained(tmp_path / "saved", experts_format=fmt,
                                                           dtype=torch.bfloat16)
    assert torch.equal(logits(again.eval()), logits(model.eval()))


def test_a_model_built_from_a_config_saves_our_layout(tmp_path):
    config = KimiK3Config(**testing.tiny_release_config(num_layers=2, num_experts=4))
    model = KimiK3ForConditionalGeneration(config)
    model.save_pretrained(tmp_path)
    names = set(_saved_tensors(tmp_path))
    assert "language_model.model.layers.1.mlp.experts.gate_up_proj" in names
    assert not any("block_sparse_moe" in n for n in names)


def test_a_save_that_fails_midway_leaves_no_folder_that_looks_finished(tmp_path, monkeypatch):
    """save_pretrained writes under a hidden temporary name beside the folder and renames it once complete: a save
    stopped by a full disk after config.json leaves no new folder and an existing one as it was; the next save
    completes and clears the partial files; a file where the folder should be is refused by its path; a process
    that is not the main one writes nothing."""
    import transformers.modeling_utils as modeling_utils

    from kimik3.modeling.saving_kimi_k3 import PARTIAL_SUFFIX
    from kimik3.tiny import build_tiny_model

    model = build_tiny_model()
    target = tmp_path / "saved"

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(modeling_utils, "safe_save_file", full_disk)
    with pytest.raises(OSError, match="No space left"):
        model.save_pretrained(target)
    assert not target.exists()
    target.mkdir()
    for name in ("config.json", "model.safetensors"):
        (target / name).write_text("the earlier save")
    with pytest.raises(OSError, match="No space left"):
        model.save_pretrained(target)
    assert sorted(p.name for p in target.iterdir()) == ["config.json", "model.safetensors"]
    assert all((target / name).read_text() == "the earlier save" for name in ("config.json", "model.safetensors"))
    monkeypatch.undo()
    model.save_pretrained(target)
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(PARTIAL_SUFFIX)]
    again = KimiK3ForCausalLM.from_pretrained(target)
    assert torch.equal(again.lm_head.weight, model.lm_head.weight)
    (tmp_path / "a-file").write_text("not a folder")
    with pytest.raises(ValueError, match=r"a-file is a file, not a folder"):
        model.save_pretrained(tmp_path / "a-file")
    # a process that writes nothing (is_main_process=False) leaves no temporary folder behind
    model.save_pretrained(tmp_path / "by-the-main-process", is_main_process=False)
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(PARTIAL_SUFFIX)]
    assert not (tmp_path / "by-the-main-process" / "config.json").exists()


# ----------------------------------------------------------------------------------------------------------------
# Bad inputs: errors name the release tensor


def _edited_copy(release, dst: Path, name: str, edit) -> Path:
    """A copy of the release folder where `edit(tensors)` changed the shard holding `name`."""
    shutil.copytree(release.path, dst)
    index_path = dst / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = index["weight_map"][name]
    tensors = load_file(dst / shard)
    edit(tensors)
    save_file(tensors, dst / shard, metadata={"format": "pt"})
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != shard}
    index["weight_map"].update(dict.fromkeys(tensors, shard))
    index_path.write_text(json.dumps(index))
    return dst


L1 = "language_model.model.layers.1."


def _set(name, value):
    def edit(tensors):
        tensors[name] = value(tensors[name])
    return edit


def _nan_at_0(t):
    t = t.clone()
    t.view(-1)[0] = float("nan")
    return t


BAD_INPUTS = {
    "missing": (L1 + "self_attn.q_proj.weight", lambda t: t.pop(L1 + "self_attn.q_proj.weight"),
                r"missing tensor\(s\): `language_model\.model\.layers\.1\.self_attn\.q_proj\.weight`"),
    "unknown": (L1 + "self_attn.q_proj.weight", lambda t: t.update({L1 + "self_attn.extra.weight": torch.ones(2)}),
                r"unknown tensor\(s\).*`language_model\.model\.layers\.1\.self_attn\.extra\.weight`"),
    "shape": (L1 + "block_sparse_moe.shared_experts.up_proj.weight",
              _set(L1 + "block_sparse_moe.shared_experts.up_proj.weight", lambda t: t[:-1].clone()),
              r"`language_model\.model\.layers\.1\.block_sparse_moe\.shared_experts\.up_proj\.weight` has shape"),
    "nan": (L1 + "block_sparse_moe.gate.e_score_correction_bias",
            _set(L1 + "block_sparse_moe.gate.e_score_correction_bias", _nan_at_0),
            r"non-finite value in release tensor `language_model\.model\.layers\.1\.block_sparse_moe\.gate\."
            r"e_score_correction_bias`"),
    "a_log_tail": (L1 + "self_attn.A_log", _set(L1 + "self_attn.A_log", lambda t: torch.cat([t[:-1], t.new_ones(1)])),
                   r"`language_model\.model\.layers\.1\.self_attn\.A_log`: entries 2\.\.127 must be the \+0\.0 padding"),
    "inf_scale": (L1 + "block_sparse_moe.experts.5.w3.weight_scale",
                  _set(L1 + "block_sparse_moe.experts.5.w3.weight_scale", lambda t: torch.full_like(t, 255)),
                  r"`language_model\.model\.layers\.1\.block_sparse_moe\.experts\.5\.w3\.weight_scale` has the E8M0 "
                  r"byte 255"),
    "expert_missing": (L1 + "block_sparse_moe.experts.5.w2.weight_packed",
                       lambda t: t.pop(L1 + "block_sparse_moe.experts.5.w2.weight_packed"),
                       r"block_sparse_moe\.experts\.\{E\}\.w2\.weight_packed`: found 7 experts.*num_experts=8"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_release_tensors_are_errors_naming_them(release, tmp_path, case):
    name, edit, message = BAD_INPUTS[case]
    folder = _edited_copy(release, tmp_path / "bad", name, edit)
    formats = FORMATS if case == "inf_scale" else ("dense",)
    for fmt in formats:
        with pytest.raises(KimiK3LoadError, match=message):
            KimiK3ForConditionalGeneration.from_pretrained(folder, experts_format=fmt, dtype=torch.bfloat16)


def test_experts_format_option_is_checked(release):
    with pytest.raises(ValueError, match="experts_format='fp8'"):
        KimiK3ForConditionalGeneration.from_pretrained(release.path, experts_format="fp8")


# ----------------------------------------------------------------------------------------------------------------
# One table of names (release_layout_kimi_k3's release name map), two users: the loader's registered transforms and the
# converter's rules (kimik3/name_map.py, generated from it) map every release pattern to the same name


def test_transforms_agree_with_the_name_map_on_all_release_patterns():
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, rename_source_key

    released = KimiK3Config(**released_config_dict())
    text = released.text_config
    with torch.device("meta"):
        tiny = KimiK3ForConditionalGeneration(KimiK3Config(**testing.tiny_release_config(num_layers=2,
                                                                                         num_experts=4)))
    patterns = json.loads(PATTERNS.read_text())["patterns"]
    assert len(patterns) == 60
    for fmt in FORMATS:
        from kimik3.modeling.release_layout_kimi_k3 import register_release_conversions

        register_release_conversions(fmt)
        mapping = get_model_conversion_mapping(tiny, add_legacy=False)
        converters = [m for m in mapping if isinstance(m, WeightConverter)]
        renamings = [m for m in mapping if not isinstance(m, WeightConverter)]
        for entry in patterns:
            layers = entry["layers_0based"]
            layer = int(layers.replace("-", ",").split(",")[0]) if layers else None
            name = nm.fill(entry["pattern"], L=layer, E=0, B=0)
            ours, _ = rename_source_key(name, renamings, converters)
            scope = "vision" if name.startswith(("vision_tower.", "mm_projector.")) else "text"
            match = nm.match_release(name.removeprefix("language_model."), text, scope)
            assert match is not None, name
            expected = nm.fill(match.rule.ours, L=layer, B=0)
            if scope == "text":
                expected = "language_model." + expected
            if isinstance(match.rule, nm.ExpertRule) and fmt == "mxfp4":
                expected += "_" + match.suffix.removeprefix("weight_")
            assert ours == expected, (fmt, name)
    register_release_conversions("dense")
    assert release_conversions("dense") and release_conversions("mxfp4")


# ----------------------------------------------------------------------------------------------------------------
# Peak memory


def anonymous_bytes():
    # RssAnon: the process's own memory (the checkpoint's mmap-ed file pages are page cache, counted in RssFile)
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024


def measure_loading(big, small):
    """Run in a forked child (k3_test_utils.run_forked): a warm-up load, then the peak of the process's own memory
    while loading `big`, sampled every 0.2 ms."""
    import threading
    import time

    os.environ.pop("HF_DEACTIVATE_ASYNC_LOAD", None)  # transformers' default loading, not a user's choice
    KimiK3ForConditionalGeneration.from_pretrained(small, dtype=torch.bfloat16)  # warm-up
    base = anonymous_bytes()
    peak, loading = [base], [True]

    def sample():
        while loading[0]:
            peak[0] = max(peak[0], anonymous_bytes())
            time.sleep(0.0002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    model = KimiK3ForConditionalGeneration.from_pretrained(big, dtype=torch.bfloat16)
    loading[0] = False
    sampler.join()
    size = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    return {"growth": peak[0] - base, "model": size}


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads RssAnon from Linux /proc/self/status")
def test_peak_memory_while_loading_is_the_model_plus_less_than_one_and_a_half_layers(tmp_path):
    """transformers' default loading (no HF_DEACTIVATE_ASYNC_LOAD from the user), which a release load switches to
    reading in step with the conversions: the process's own memory beyond the model stays below one and a half
    dequantised layers, whatever the model's size. The threaded read-ahead gave 3.2 and 8.1 layers at 4 and 16
    layers; reading in step left 1.8-2.0, of which 1.1-1.3 were the finite check's fixed 16M-element blocks (a layer
    here is 25 MB); with 2M-element blocks 0.55-1.08 remain (24 loads of this checkpoint on a 2-core AMD EPYC VM, the
    code before and after 2026-12-06's changes alike: the bound of one layer failed one run in four there). Sampled
    every 0.2 ms while loading."""
    wide = {"hidden_size": 256, "moe_intermediate_size": 256, "routed_expert_hidden_size": 256,
            "intermediate_size": 256, "vocab_size": 1024}
    big = testing.write_release_checkpoint(tmp_path / "big", num_layers=8, num_experts=64, config_overrides=wide,
                                           vision=False, return_dense=False, seed=4)
    small = testing.write_release_checkpoint(tmp_path / "small", num_layers=2, num_experts=4, vision=False,
                                             return_dense=False)
    returncode, measured, error = run_forked(measure_loading, str(big.path), str(small.path))
    assert returncode == 0 and measured is not None, error
    layer = 64 * 3 * 256 * 256 * 2  # one layer's experts dequantised to bf16: what one layer shard becomes
    assert measured["model"] > 6 * layer, measured
    assert measured["growth"] < measured["model"] + 1.5 * layer, measured


def test_finite_check_finds_a_value_past_its_first_blocks():
    """The scan goes block by block (FINITE_CHECK_BLOCK elements): an Inf in a later block, past a block boundary, of
    a tensor several blocks long is found and named at its own index; a NaN in the last, partial block too."""
    from kimik3.modeling import release_layout_kimi_k3 as conversion

    block = conversion.FINITE_CHECK_BLOCK
    holder = torch.nn.Module()
    holder.weight = torch.nn.Parameter(torch.zeros(3, block + 7), requires_grad=False)
    conversion._check_finite(holder)  # finite: passes
    for flat_index, value in ((2 * block + 5, float("inf")), (3 * (block + 7) - 1, float("nan"))):
        holder.weight.data.zero_()
        holder.weight.data.view(-1)[flat_index] = value
        row, col = divmod(flat_index, block + 7)
        with pytest.raises(KimiK3LoadError, match=rf"`weight` at index \[{row}, {col}\]"):
            conversion._check_finite(holder)
