"""One concept, one name; one fact, one place: the expert format is `experts_format` (dense | mxfp4) in the config,
the load option, `kimik3 convert` and `kimik3 memory` alike, read from one constant of the remote code; a value of
another vocabulary (the removed `--experts-dtype`, `bf16`) is refused naming the option."""

import ast
import functools
import json
import re

import pytest

import kimik3.convert as kc
from kimik3.cli import main
from kimik3.configuration import tiny_text_config_dict
from kimik3.convert.errors import ConversionError
from kimik3.memory import device_plan, load_text_config, weight_units
from kimik3.modeling import configuration_kimi_k3 as configuration
from kimik3.modeling.configuration_kimi_k3 import KimiK3TextConfig

PLAN = ["memory", "--plan", "--gpus", "8", "--gpu-mem", "141GB"]


@pytest.mark.parametrize("argv,message", [
    pytest.param([*PLAN, "--experts-format", "bf16"], "kimik3 memory: error: argument --experts-format: invalid "
                 "choice: 'bf16' (choose from 'dense', 'mxfp4')", id="memory-experts-format-bf16"),
    pytest.param([*PLAN, "--experts-dtype", "mxfp4"], "kimik3 memory: error: unrecognized arguments: --experts-dtype "
                 "mxfp4", id="memory-experts-dtype-removed"),
    pytest.param(["memory", "--experts-format", "dense"], "kimik3 memory: error: argument --experts-format: only with "
                 "--plan", id="memory-experts-format-without-plan"),
    pytest.param(["convert", "src", "dst", "--experts-dtype", "bf16"], "kimik3 convert: error: unrecognized "
                 "arguments: --experts-dtype bf16", id="convert-experts-dtype-removed"),
    pytest.param(["convert", "src", "dst", "--experts-format", "bf16"], "kimik3 convert: error: argument "
                 "--experts-format: invalid choice: 'bf16' (choose from 'dense', 'mxfp4')",
                 id="convert-experts-format-bf16"),
    pytest.param(["convert", "src", "dst", "--experts-format", "MXFP4"], "kimik3 convert: error: argument "
                 "--experts-format: invalid choice: 'MXFP4'", id="convert-experts-format-uppercase"),
])
def test_expert_format_flags_refuse_other_names(capsys, argv, message):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.fixture(scope="module")
def config_folder(tmp_path_factory):
    """A folder holding only a tiny text config.json: enough for the load option's check, which runs before any
    weight is read."""
    folder = tmp_path_factory.mktemp("config-only")
    (folder / "config.json").write_text(json.dumps(KimiK3TextConfig(**tiny_text_config_dict()).to_dict()))
    return folder


def _memory_api():
    weight_units(load_text_config(None), "bf16")


def _plan_api():
    device_plan(load_text_config(None), 8, 141 * 10**9, 4096, experts_format="bf16")


def _load_option(folder, value="bf16"):
    from kimik3.modeling.modeling_kimi_k3 import KimiK3ForCausalLM

    KimiK3ForCausalLM.from_pretrained(folder, experts_format=value)


@pytest.mark.parametrize("call,error,message", [
    pytest.param(lambda folder: _memory_api(), ValueError, r"experts_format='bf16': choose 'dense' or 'mxfp4'",
                 id="memory-api-experts-format-bf16"),
    pytest.param(lambda folder: _plan_api(), ValueError, r"experts_format='bf16': choose 'dense' or 'mxfp4'",
                 id="plan-api-experts-format-bf16"),
    pytest.param(_load_option, ValueError, r"experts_format='bf16': choose 'dense' or 'mxfp4'",
                 id="load-experts-format-bf16"),
    pytest.param(lambda folder: _load_option(folder, ["mxfp4"]), ValueError,
                 r"experts_format=\['mxfp4'\]: choose 'dense' or 'mxfp4'", id="load-experts-format-not-a-string"),
    pytest.param(lambda folder: KimiK3TextConfig(**{**tiny_text_config_dict(), "experts_format": None}),
                 ValueError, r"key `experts_format`: must be 'dense' or 'mxfp4', got None",
                 id="config-experts-format-null"),
    pytest.param(lambda folder: KimiK3TextConfig(**{**tiny_text_config_dict(), "experts_format": "bf16"}),
                 ValueError, r"key `experts_format`: must be 'dense' or 'mxfp4', got 'bf16'",
                 id="config-experts-format-bf16"),
    pytest.param(lambda folder: kc.convert(folder, folder.parent / "never-written", experts_format="bf16"),
                 ConversionError, r"--experts-format 'bf16': the converter writes dense or mxfp4",
                 id="convert-api-experts-format-bf16"),
])
def test_expert_format_apis_refuse_other_names(config_folder, call, error, message):
    with pytest.raises(error, match=message):
        call(config_folder)
    assert not (config_folder.parent / "never-written").exists()


def test_every_flag_and_api_reads_the_one_constant(monkeypatch, capsys):
    """The allowed values and the defaults are configuration_kimi_k3's: change them there and every reader follows
    (argparse choices, --help, the memory plan's default, the load option's check)."""
    from kimik3.convert import cli as convert_cli
    from kimik3.convert import converter

    assert tuple(configuration.EXPERTS_FORMATS) == ("dense", "mxfp4")
    assert (configuration.DEFAULT_EXPERTS_FORMAT, configuration.RELEASE_EXPERTS_FORMAT) == ("dense", "mxfp4")
    # the converter's parser and check read its one table of the storages it streams, which holds the registry's
    # own objects (the release's two)
    from kimik3.convert import plan

    assert convert_cli.STREAMED_FORMATS is plan.STREAMED_FORMATS
    assert all(fmt is configuration.EXPERTS_FORMATS[name] for name, fmt in plan.STREAMED_FORMATS.items())
    assert tuple(plan.STREAMED_FORMATS) == tuple(configuration.EXPERTS_FORMATS)
    assert convert_cli.DEFAULT_EXPERTS_FORMAT is converter.DEFAULT_EXPERTS_FORMAT is configuration.DEFAULT_EXPERTS_FORMAT
    assert main(["memory", "--help"]) == 0
    assert "one of dense, mxfp4," in " ".join(capsys.readouterr().out.split())
    # a format registered in experts_format_kimi_k3 is a value everywhere
    from kimik3.modeling.experts_format_kimi_k3 import EXPERTS_FORMATS, ExpertsFormat

    stand_in = type("Fp8Experts", (ExpertsFormat,), {"name": "fp8"})()
    monkeypatch.setitem(EXPERTS_FORMATS, "fp8", stand_in)
    monkeypatch.setattr(configuration, "RELEASE_EXPERTS_FORMAT", "dense")
    assert main(["memory", "--help"]) == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "one of dense, mxfp4, fp8," in help_text and "default dense, the release's own" in help_text
    config = load_text_config(None)
    assert device_plan(config, 8, 141 * 10**9, 4096)["experts_format"] == "dense"
    with pytest.raises(ValueError, match="choose 'dense' or 'mxfp4' or 'fp8'"):
        weight_units(config, "bf16")


# ----------------------------------------------------------------------------------------------------------------
# One fact, one place

REPO = __import__("pathlib").Path(__file__).resolve().parents[1]
SHIPPED = [path for folder in ("modeling_kimik3", "convert", "kimik3", "kernels", "hub_card", "configuration")
           for path in sorted((REPO / folder).rglob("*.py"))]


@functools.lru_cache(maxsize=None)
def _text(path) -> str:
    return path.read_text(encoding="utf-8")


@functools.lru_cache(maxsize=None)
def _tree(path):
    return ast.parse(_text(path))


def _module_constants(path):
    """(name, value node) of each module-level assignment of one shipped file."""
    for node in _tree(path).body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) and node.value is not None else []
        for target in targets:
            for name in ([target] if isinstance(target, ast.Name) else getattr(target, "elts", [])):
                if isinstance(name, ast.Name):
                    yield name.id, node.value


@functools.lru_cache(maxsize=None)
def _string_literals(path) -> frozenset:
    """Every string constant of one file that is not a docstring."""
    tree = _tree(path)
    docstrings = {id(body[0].value) for body in [tree.body] + [n.body for n in ast.walk(tree) if isinstance(
        n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))] if body and isinstance(body[0], ast.Expr)}
    return frozenset(n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
                     and id(n) not in docstrings)


def test_each_shared_fact_is_defined_once():
    """Each of these names is given a value in one shipped module; any other module imports it (an alias such as
    `OUR_AUTO_TOKENIZER = AUTO_TOKENIZER` is an import, not a second value). The values themselves appear once.
    Only the files whose text holds a name or value are parsed."""
    facts = ("EXPERTS_FORMATS", "DEFAULT_EXPERTS_FORMAT", "RELEASE_EXPERTS_FORMAT", "PROVENANCE_NAME",
             "PROCESSOR_CODE_FILES", "PROCESSOR_CONFIG_NAME", "KERNELS_API_VERSION", "TEXT_AUTO_MAP",
             "COMPOSITE_AUTO_MAP", "PROCESSOR_AUTO_MAP", "AUTO_TOKENIZER", "OUR_AUTO_TOKENIZER", "EXPERT_PARTS",
             "RELEASE_A_LOG_LENGTH", "TEXT_PREFIX", "RELEASE_TEXT_PREFIX")
    defined = {name: [] for name in facts}
    assigning = re.compile(r"^(" + "|".join(facts) + r")\b", flags=re.MULTILINE)
    for path in [p for p in SHIPPED if assigning.search(_text(p))]:
        for name, value in _module_constants(path):
            if name in defined and not isinstance(value, (ast.Name, ast.Attribute)):
                defined[name].append(path.relative_to(REPO).as_posix())
    assert {name: where for name, where in defined.items() if len(where) > 1} == {}
    assert all(defined[name] for name in ("EXPERTS_FORMATS", "PROVENANCE_NAME", "KERNELS_API_VERSION",
                                          "PROCESSOR_CODE_FILES", "TEXT_AUTO_MAP", "EXPERT_PARTS"))
    for value in ("kimik3_conversion.json", "multimodal_kimi_k3.KimiK3MultimodalModel"):
        holders = [p.relative_to(REPO).as_posix() for p in SHIPPED
                   if value in _text(p) and value in _string_literals(p)]
        assert len(holders) == 1, (value, holders)
    # the processor's code files are read from its imports: no shipped file lists them by hand
    listed = "image_processing_kimi_k3.py"
    assert [p.name for p in SHIPPED if listed in _text(p) and listed in _string_literals(p)] == []


def test_the_release_name_map_is_one_table():
    """The converter's rules of the MoE block and the experts are generated from the remote code's release name map
    (release_layout_kimi_k3), from which the loader's transforms are built: name_map.py spells none of its names, nor do
    the engines that read and write expert tensors by them (plan.py, verifier.py), and both sides agree on every
    rule. (tests/test_release_loading.py runs both on the release's 60 name patterns.)"""
    from kimik3 import name_map as nm
    from kimik3.modeling import release_layout_kimi_k3 as names

    literals = _string_literals(REPO / "kimik3" / "name_map.py")
    words = ("block_sparse_moe", "weight_packed", "weight_scale", "language_model")
    spelled = [s for s in sorted(literals)
               if any(word in s for word in words) or s in ("w1", "w2", "w3", "mlp.", "gate_up_proj_packed")]
    assert spelled == []
    engine_words = words + ("_packed", "_scale", "gate_up_proj", "down_proj")
    for engine in ("plan.py", "verifier.py"):
        literals = _string_literals(REPO / "convert" / engine)
        spelled = [s for s in sorted(literals) if any(word in s for word in engine_words)
                   or s in ("w1", "w2", "w3", "weight", ".weight")]
        assert spelled == [], engine
    assert nm.FUSED_PACKED_SUFFIXES == tuple(names.OUR_PACKED_SUFFIXES[s]
                                             for s in names.RELEASE_EXPERT_SUFFIXES["mxfp4"])
    assert nm.FUSED_EXPERTS == tuple(f"{names.OUR_MOE_BLOCK}.experts.{fused}" for fused in names.EXPERT_PARTS)
    assert [(rule.ours.rsplit(".", 1)[-1], rule.parts) for rule in nm.EXPERT_RULES] == list(names.EXPERT_PARTS.items())
    assert (nm.PLAIN_SUFFIXES, nm.PACKED_SUFFIXES) == (names.RELEASE_EXPERT_SUFFIXES["dense"],
                                                       names.RELEASE_EXPERT_SUFFIXES["mxfp4"])
    for rule in nm.TENSOR_RULES:
        if rule.scope == "text":  # the loader's release name of each of our names is the rule's release name
            assert names.release_name(rule.ours) == rule.release, rule
    # a rule under the MoE block that the loader would not rename is refused when the table is built
    with pytest.raises(AssertionError, match=r"block_sparse_moe.router.weight: not a child of the MoE block"):
        nm._moe("router.weight", ("E", "D"))


def test_processor_code_files_are_the_processors_imports():
    """One list, made from processing_kimi_k3's own imports: a processor folder gets all of them, a model folder
    the same less the tokenizer's file (the tokenizer's save writes it). A model folder carries the whole remote code
    but the tokenizer's file, read from the carried modules' imports (saving_kimi_k3.CARRIED_MODULES)."""
    from kimik3.modeling import saving_kimi_k3 as saving
    from kimik3.modeling.processing_kimi_k3 import PROCESSOR_CODE_FILES
    from kimik3.remote_code import modeling_dir, remote_code_files

    assert PROCESSOR_CODE_FILES == (
        "processing_kimi_k3.py", "files_kimi_k3.py", "image_processing_kimi_k3.py", "tokenization_kimi_k3.py")
    model_copies = [p.name for p in saving.carried_code_files([REPO / "no-such-folder", modeling_dir()])]
    processor_copies = set(PROCESSOR_CODE_FILES) - {saving.TOKENIZER_CODE_FILE}
    assert processor_copies <= set(model_copies) and saving.TOKENIZER_CODE_FILE not in model_copies
    # every file but the decode loop, which a folder carries as custom_generate/generate.py (saving_kimi_k3)
    every_file = sorted(p.name for p in modeling_dir().glob("*.py") if p.name not in ("__init__.py",
                                                                                       saving.DECODE_LOOP_FILE))
    assert sorted(model_copies) == sorted(set(every_file) - {saving.TOKENIZER_CODE_FILE})
    assert [p.name for p in remote_code_files()] == every_file
    assert saving.auto_map_for({"text_config": {}}) == saving.COMPOSITE_AUTO_MAP
    assert saving.auto_map_for({}) == saving.TEXT_AUTO_MAP
