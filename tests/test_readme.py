"""The README runs as written: its cheap bash lines and python blocks are executed here (on the tiny model), its
set-up commands are the ones CI runs, and the docs cite no file a user does not have. A block that is not run is
listed below with the reason, so a new block cannot go untested silently."""

import contextlib
import io
import os
import re
import shlex
from pathlib import Path

import pytest

from kimik3.cli import main

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
}
# Python blocks not run, by their first line: what they need that a CPU test does not have.
PYTHON_NOT_RUN = {
    "out = model.generate(ids, max_new_tokens=256, cache_implementation=\"static\")": "compiled decode on CUDA "
    "(tests/gpu/test_compiled_decode.py)",
    "model = AutoModelForCausalLM.from_pretrained(\"kimi-k3-hf\", trust_remote_code=True,": "the released model on "
    "16 GPUs under torchrun (the sharded load of packed experts on two gloo ranks: tests/test_parallel.py)",
    "offloaded = AutoModelForCausalLM.from_pretrained(\"kimi-k3-hf\", trust_remote_code=True,": "the released model "
    "on one GPU with its routed experts in host memory (the mechanism on the tiny model: tests/test_offload.py)",
}


@contextlib.contextmanager
def working_directory(path: Path):
    before = Path.cwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


def code_blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.DOTALL)


def bash_lines() -> list[str]:
    return [line.strip() for block in code_blocks(README, "bash") for line in block.splitlines() if line.strip()]


def command_part(line: str) -> str:
    return line.split("  #")[0].strip()


@pytest.fixture(scope="module")
def readme_dir(tmp_path_factory):
    """A folder in which the README's `kimik3 tiny` line has run (the usage block reads `tiny-k3` from there)."""
    folder = tmp_path_factory.mktemp("readme")
    with working_directory(folder):
        for line in bash_lines():
            if line.startswith("kimik3 tiny "):
                assert main(shlex.split(line)[1:]) == 0
    assert (folder / "tiny-k3" / "config.json").is_file()
    return folder


def test_set_up_commands_cpu_and_gpu_and_ci_runs_the_readme_ones():
    setup = README[README.index("## Set up on a fresh machine"):README.index("## Usage")]
    cpu, gpu = (code_blocks(setup, "bash")[i].strip().splitlines() for i in (0, 1))
    # two commands each: the main job, then the tests
    assert [line.split(" && ")[-1] for line in cpu] == ["kimik3 demo", "python -m pytest -q tests"]
    assert [line.split(" && ")[-1] for line in gpu] == ["kimik3 demo", "python -m pytest -q tests"]
    assert all(line.startswith(f"pip install torch==2.13.0 {CPU_WHEELS} && ") for line in cpu)
    assert all(CPU_WHEELS not in line and '.[gpu]' in line.replace("test,", "") for line in gpu)
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert ci[-1] == cpu[1]  # CI installs exactly as the README says and runs its test command
    setup_py = (ROOT / "setup.py").read_text()
    assert re.search(r'"gpu": \["fla-core[^"]*"\]', setup_py) and re.search(r'"train": \["peft[^"]*"\]', setup_py)


def test_cheap_bash_lines_run_and_the_rest_are_accounted_for(readme_dir):
    ran, skipped = [], set()
    for line in bash_lines():
        command = command_part(line)
        reason = next((key for key in NOT_RUN if command.startswith(key)), None)
        if reason is not None:
            skipped.add(reason)
            continue
        argv = shlex.split(command)
        assert argv[0] == "kimik3", f"README bash line neither run nor listed in NOT_RUN: {line}"
        if argv[1] == "tiny":  # ran in the fixture
            continue
        out = io.StringIO()
        with working_directory(readme_dir), contextlib.redirect_stdout(out):
            code = main(argv[1:])
        assert code == 0, line
        ran.append((command, out.getvalue()))
    assert skipped == set(NOT_RUN), "a NOT_RUN entry matches no README line any more"
    outputs = dict(ran)
    # the README's memory table is what `kimik3 memory` prints; --reconcile reproduces every quoted figure
    table = outputs["kimik3 memory"]
    for row in re.findall(r"^\| ([\d,]+) \| (.*) \|$", README, flags=re.MULTILINE):
        values = [cell.replace(" GiB", "") for cell in row[1].split(" | ")]
        printed = next(line for line in table.splitlines() if line.strip().startswith(row[0].replace(",", "")))
        assert [v.replace(",", "") for v in re.findall(r"([\d,.]+) GiB", printed)] == [v.replace(",", "") for v in
                                                                                       values]
    assert outputs["kimik3 memory --reconcile"].count("matches") == 5


def test_python_blocks_run(readme_dir):
    from transformers import Trainer, TrainingArguments

    blocks = code_blocks(README, "python")
    run = [block for block in blocks if not any(block.startswith(first) for first in PYTHON_NOT_RUN)]
    assert len(blocks) - len(run) == len(PYTHON_NOT_RUN)
    usage = next(block for block in run if "AutoTokenizer" in block)
    out = io.StringIO()
    with working_directory(readme_dir), contextlib.redirect_stdout(out):
        namespace = {}
        exec(compile(usage, "README.md (usage)", "exec"), namespace)
    decoded = eval(out.getvalue())  # the block prints the two continuations
    assert isinstance(decoded, list) and len(decoded) == 2 and all(isinstance(t, str) for t in decoded)
    assert namespace["out"].shape[1] == namespace["batch"]["input_ids"].shape[1] + 8
    # the fine-tuning fragment runs against a model, arguments and data of the names it uses
    for block in run:
        if block is usage:
            continue
        args = TrainingArguments(output_dir=str(readme_dir / "trainer"), report_to=[], use_cpu=True)
        fragment = {"Trainer": Trainer, "model": namespace["model"], "args": args, "ds": [], **namespace}
        exec(compile(block, "README.md (fragment)", "exec"), fragment)
        callbacks = [type(c).__name__ for c in fragment["trainer"].callback_handler.callbacks]
        assert "QuantileBalancingCallback" in callbacks


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
