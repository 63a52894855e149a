"""One concept, one name; one fact, one place: the expert format is `experts_format` (dense | mxfp4) in the config,
the load option, `kimik3 convert` and `kimik3 memory` alike, read from one constant of the remote code; a value of
another vocabulary (the removed `--experts-dtype`, `bf16`) is refused naming the option."""

import json

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


def _load_option(folder):
    from kimik3.modeling.modeling_kimi_k3 import KimiK3ForCausalLM

    KimiK3ForCausalLM.from_pretrained(folder, experts_format="bf16")


@pytest.mark.parametrize("call,error,message", [
    pytest.param(lambda folder: _memory_api(), ValueError, r"experts_format='bf16': choose 'dense' or 'mxfp4'",
                 id="memory-api-experts-format-bf16"),
    pytest.param(lambda folder: _plan_api(), ValueError, r"experts_format='bf16': choose 'dense' or 'mxfp4'",
                 id="plan-api-experts-format-bf16"),
    pytest.param(_load_option, ValueError, r"experts_format='bf16': choose 'dense' or 'mxfp4'",
                 id="load-experts-format-bf16"),
    pytest.param(lambda folder: KimiK3TextConfig(**{**tiny_text_config_dict(), "experts_format": "bf16"}),
                 ValueError, r"key `experts_format`: must be 'dense' or 'mxfp4', got 'bf16'",
                 id="config-experts-format-bf16"),
    pytest.param(lambda folder: kc.convert(folder, folder.parent / "never-written", experts_format="bf16"),
                 ConversionError, r"--experts-format 'bf16': choose dense or mxfp4",
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

    assert configuration.EXPERTS_FORMATS == ("dense", "mxfp4")
    assert (configuration.DEFAULT_EXPERTS_FORMAT, configuration.RELEASE_EXPERTS_FORMAT) == ("dense", "mxfp4")
    # the converter's parser and check use the constant itself, not a copy
    assert convert_cli.EXPERTS_FORMATS is converter.EXPERTS_FORMATS is configuration.EXPERTS_FORMATS
    assert convert_cli.DEFAULT_EXPERTS_FORMAT is configuration.DEFAULT_EXPERTS_FORMAT
    assert main(["memory", "--help"]) == 0
    assert "--experts-format {dense,mxfp4}" in capsys.readouterr().out
    monkeypatch.setattr(configuration, "EXPERTS_FORMATS", ("dense", "mxfp4", "fp8"))
    monkeypatch.setattr(configuration, "RELEASE_EXPERTS_FORMAT", "dense")
    assert main(["memory", "--help"]) == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--experts-format {dense,mxfp4,fp8}" in help_text and "default dense, the release's own" in help_text
    config = load_text_config(None)
    assert device_plan(config, 8, 141 * 10**9, 4096)["experts_format"] == "dense"
    with pytest.raises(ValueError, match="choose 'dense' or 'mxfp4' or 'fp8'"):
        weight_units(config, "bf16")
