"""The README runs as written, the way users run it: its cheap bash lines and python blocks are executed in fresh
interpreters (on the tiny model, loaded from its folder with trust_remote_code), the python blocks both from outside
the checkout and with the checkout's root first on sys.path (Python started in the root: `python -m`, a REPL, a
notebook); its set-up commands are the ones CI runs, and the docs cite no file a user does not have. A block that is
not run is listed below with the reason, so a new block cannot go untested silently."""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
CPU_WHEELS = "--index-url https://download.pytorch.org/whl/cpu"

# Lines of bash blocks that are not run here, each with the reason (asserted to be exactly the README's others).
NOT_RUN = {
    "pip install": "installs packages (CI runs the CPU set-up through .ci/run)",
    "kimik3 convert moonshotai/Kimi-K3": "needs the released checkpoint (1.5 TB)",
    "kimik3 verify  moonshotai/Kimi-K3": "needs the released checkpoint",
    "kimik3 export  ./my-finetune": "needs a fine-tuned folder; export is tested in test_convert_roundtrip.py",
    "python examples/finetune_tiny.py": "a 10-step fine-tune (about 10 s); its quiet path is in test_quiet_paths.py",
    "kimik3 serve K3_DIR": "a server that runs until stopped; tests/test_serve.py serves a tiny folder",
}
# Python blocks not run, by their first line: what they need that a CPU test does not have.
PYTHON_NOT_RUN = {
    "out = model.generate(ids, max_new_tokens=256, cache_implementation=\"static\")": "compiled decode on CUDA "
    "(tests/gpu/test_compiled_decode.py)",
    "model = AutoModelForCausalLM.from_pretrained(\"kimi-k3-hf\", trust_remote_code=True,": "the released model on "
    "16 GPUs under torchrun (the sharded load of packed experts on two gloo ranks: tests/test_parallel.py)",
    "offloaded = AutoModelForCausalLM.from_pretrained(\"kimi-k3-hf\", trust_remote_code=True,": "the released model "
    "on one GPU with its routed experts in host memory (the mechanism on the tiny model: tests/test_offload.py)",
    "from openai import OpenAI": "a running `kimik3 serve` (tests/test_serve.py talks to one with the openai client)",
}


def code_blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.DOTALL)


def bash_lines() -> list[str]:
    return [line.strip() for block in code_blocks(README, "bash") for line in block.splitlines() if line.strip()]


def command_part(line: str) -> str:
    return line.split("  #")[0].strip()


# One fresh interpreter runs the README's `kimik3` lines in order, as the console script does (`kimik3.cli.main`),
# and answers with each line's exit code and output.
CLI_RUNNER = r"""
import contextlib, io, json, shlex, sys
from kimik3.cli import main
results = []
for line in json.loads(sys.argv[1]):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(shlex.split(line)[1:])
    results.append([line, code, out.getvalue()])
print("\x00" + json.dumps(results))
"""


def run_fresh(code: str, cwd: Path, *argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *argv], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": ""})


def readme_commands() -> tuple[list[str], set[str]]:
    """(the README's `kimik3` lines to run, the NOT_RUN reasons met); a line of neither kind fails here."""
    run, skipped = [], set()
    for line in bash_lines():
        command = command_part(line)
        reason = next((key for key in NOT_RUN if command.startswith(key)), None)
        if reason is not None:
            skipped.add(reason)
            continue
        assert shlex.split(command)[0] == "kimik3", f"README bash line neither run nor listed in NOT_RUN: {line}"
        run.append(command)
    return run, skipped


@pytest.fixture(scope="module")
def readme_run(tmp_path_factory):
    """A folder outside the checkout in which the README's `kimik3` lines ran, `kimik3 tiny` first (the python blocks
    read `tiny-k3` from there), in one fresh interpreter; {line: output}."""
    folder = tmp_path_factory.mktemp("readme")
    commands, _ = readme_commands()
    commands.sort(key=lambda line: not line.startswith("kimik3 tiny "))
    result = run_fresh(CLI_RUNNER, folder, json.dumps(commands))
    assert result.returncode == 0 and "\x00" in result.stdout, result.stderr[-3000:]
    ran = json.loads(result.stdout.split("\x00", 1)[1])
    for line, code, _ in ran:
        assert code == 0, f"README line {line!r} exited {code}"
    assert (folder / "tiny-k3" / "config.json").is_file()
    return folder, {line: out for line, _, out in ran}


@pytest.fixture(scope="module")
def readme_dir(readme_run):
    return readme_run[0]


def test_set_up_commands_cpu_and_gpu_and_ci_runs_the_readme_ones():
    setup = README[README.index("## Set up on a fresh machine"):README.index("## Usage")]
    cpu, gpu = (code_blocks(setup, "bash")[i].strip().splitlines() for i in (0, 1))
    # two commands each: the main job, then the tests
    assert [line.split(" && ")[-1] for line in cpu] == ["kimik3 demo", "python -m pytest -q tests"]
    assert [line.split(" && ")[-1] for line in gpu] == ["kimik3 demo", "python -m pytest -q tests"]
    assert all(line.startswith(f"pip install torch==2.13.0 {CPU_WHEELS} && ") for line in cpu)
    assert all(CPU_WHEELS not in line and '.[gpu]' in line.replace("test,", "") for line in gpu)
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert cpu[1] in ci  # CI installs exactly as the README says and runs its test command (the newest transformers)
    # then the same tests on the oldest transformers setup.py claims, the floor read from setup.py (one place)
    oldest = [line for line in ci[ci.index(cpu[1]) + 1:] if ".venv-oldest" in line or "oldest" in line]
    assert any("setup.py" in line and "transformers>=" in line for line in oldest)
    assert any('"transformers==$oldest"' in line for line in oldest)
    assert oldest[-1].startswith("timeout ") and oldest[-1].endswith("-m pytest -q tests")
    floor = re.search(r'"transformers>=([0-9.]+)', (ROOT / "setup.py").read_text()).group(1)
    assert f"`transformers` {floor}\nthrough the newest 5.x (CI runs the tests on {floor}.0 and on what pip " in README
    setup_py = (ROOT / "setup.py").read_text()
    assert re.search(r'"gpu": \["fla-core[^"]*"\]', setup_py) and re.search(r'"train": \["peft[^"]*"', setup_py)


def test_cheap_bash_lines_run_and_the_rest_are_accounted_for(readme_run):
    _, outputs = readme_run
    commands, skipped = readme_commands()
    assert set(outputs) == set(commands)
    assert skipped == set(NOT_RUN), "a NOT_RUN entry matches no README line any more"
    # the README's memory table is what `kimik3 memory` prints; --reconcile reproduces every quoted figure
    table = outputs["kimik3 memory"]
    for row in re.findall(r"^\| ([\d,]+) \| (.*) \|$", README, flags=re.MULTILINE):
        values = [cell.replace(" GiB", "") for cell in row[1].split(" | ")]
        printed = next(line for line in table.splitlines() if line.strip().startswith(row[0].replace(",", "")))
        assert [v.replace(",", "") for v in re.findall(r"([\d,.]+) GiB", printed)] == [v.replace(",", "") for v in
                                                                                       values]
    assert outputs["kimik3 memory --reconcile"].count("matches") == 5


def readme_script() -> str:
    """The README's python blocks that run here, in its order, as one script: the fine-tuning fragment gets the
    names it uses (`args`, `ds`) defined before it. It ends by printing what the test checks."""
    blocks = code_blocks(README, "python")
    run = [block for block in blocks if not any(block.startswith(first) for first in PYTHON_NOT_RUN)]
    assert len(blocks) - len(run) == len(PYTHON_NOT_RUN)
    parts = []
    for block in run:
        if "Trainer(" in block:
            parts.append("from transformers import Trainer, TrainingArguments\n"
                         "args = TrainingArguments(output_dir='trainer-out', report_to=[], use_cpu=True)\nds = []\n")
        parts.append(block)
    parts.append("import json, sys, transformers\n"
                 "print('\\x00' + json.dumps({'generated': [int(out.shape[1]), int(batch['input_ids'].shape[1])],\n"
                 "    'model_module': type(model).__module__, 'model32_module': type(model32).__module__,\n"
                 "    'callbacks': [type(c).__name__ for c in trainer.callback_handler.callbacks],\n"
                 "    'kernels': sys.modules['kernels'].__file__ if 'kernels' in sys.modules else None,\n"
                 "    'hub_kernels': 'transformers.integrations.hub_kernels' in sys.modules,\n"
                 "    'path0': sys.path[0], 'ours': sys.modules['kimik3.kernels.mxfp4'].__file__\n"
                 "        if 'kimik3.kernels.mxfp4' in sys.modules else None,\n"
                 "    'kernels_spec': _kernels_spec.origin if globals().get('_kernels_spec') else None}))\n")
    return "\n".join(parts)


# Python started in the checkout's root puts the root first on sys.path (`python -m` its absolute path, `python -c`
# and a REPL the current folder): the script does the same, then works in the folder with tiny-k3. There it also
# imports transformers' hub kernels, which import PyPI's `kernels` (transformers 5.25 needs it; older ones may lack
# it), and every package of ours (the README's `python -m pytest -q tests` starts there too).
FROM_ROOT = ("import os, sys\nsys.path.insert(0, os.getcwd())\n"
             "from transformers.integrations import hub_kernels\n"
             "import kimik3.kernels, kimik3.kernels.mxfp4, kimik3.modeling.modeling_kimi_k3, kimik3.convert\n"
             "import importlib.util\n_kernels_spec = importlib.util.find_spec('kernels')\n"
             "os.chdir(sys.argv[1])\n")


@pytest.mark.parametrize("where", ["outside the checkout", "the checkout's root"])
def test_python_blocks_run_in_a_fresh_interpreter(readme_dir, where):
    from_root = where == "the checkout's root"
    script = (FROM_ROOT if from_root else "") + readme_script()
    result = run_fresh(script, ROOT if from_root else readme_dir, str(readme_dir))
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.split("\x00", 1)[1])
    decoded = eval(result.stdout.split("\x00", 1)[0].strip().splitlines()[-1])  # the usage block prints them
    assert isinstance(decoded, list) and len(decoded) == 2 and all(isinstance(t, str) for t in decoded)
    assert report["generated"][0] == report["generated"][1] + 8
    # the models run the folder's own code (trust_remote_code), not the installed package's classes
    assert report["model_module"].startswith("transformers_modules.")
    assert report["model32_module"].startswith("transformers_modules.")
    assert "QuantileBalancingCallback" in report["callbacks"]
    # PyPI's kernels, not the checkout's folder, whatever transformers imported of it
    assert report["kernels"] is None or Path(report["kernels"]).parent.parent != ROOT
    if from_root:
        assert report["path0"] == str(ROOT)  # the root is first, as for every user started there
        assert report["kernels_spec"] is None or not Path(report["kernels_spec"]).is_relative_to(ROOT)
        assert Path(report["ours"]).is_relative_to(ROOT)


def test_docs_cite_no_files_a_user_does_not_have():
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text(encoding="utf-8")
        for needle in ("shared/", "k3_math", "k3_checkpoint", "transformers_v5.md", "peers_users"):
            assert needle not in text, f"{path.name} cites {needle}"
        for target in re.findall(r"\]\(((?:docs/)?[\w./-]+\.md)(?:#[\w-]+)?\)", text):
            assert (path.parent / target).is_file(), f"{path.name} links to a missing {target}"
    architecture = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    headings = {re.sub(r"[^\w -]", "", h).strip().lower().replace(" ", "-")
                for h in re.findall(r"^#+ (.*)$", architecture, flags=re.MULTILINE)}
    for anchor in re.findall(r"architecture\.md#([\w-]+)", README + (ROOT / "docs" / "training.md").read_text()):
        assert anchor in headings, anchor
