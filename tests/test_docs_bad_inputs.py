"""docs/bad_inputs.md stays in sync with the tests it cites: every parametrised case id of the bad-input tests is a
row of its tables, and every id in a table's first column is a real case (read from the test sources with ast, so
nothing is imported or run)."""

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "bad_inputs.md"
CASE_FILES = ["test_bad_inputs_reading.py", "test_bad_inputs_runs.py", "test_model_inputs.py", "test_vocabulary.py",
              "test_bad_inputs_loading.py", "test_bad_inputs_chat.py", "test_bad_inputs_config.py", "test_chat_cli.py",
              "test_hub_card.py", "test_adopt.py", "test_memory_plan.py", "test_offload.py", "test_parallel.py",
              "test_prefix_reuse.py", "test_bad_inputs_calls.py", "test_training_lora_packed.py",
              "test_offload_host_compute.py", "test_host_experts.py",
              "test_serve.py"]


def _is_pytest_call(node: ast.Call, name: str) -> bool:
    func = node.func
    return isinstance(func, ast.Attribute) and func.attr == name and (
        name == "param" and isinstance(func.value, ast.Name) and func.value.id == "pytest"
        or name == "parametrize" and isinstance(func.value, ast.Attribute) and func.value.attr == "mark"
    )


def case_ids(path: Path) -> list[str]:
    """The `id=` of each `pytest.param` and the `ids=[...]` of each `@pytest.mark.parametrize` in one test file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not isinstance(node, ast.Call):
            continue
        wanted = "id" if _is_pytest_call(node, "param") else "ids" if _is_pytest_call(node, "parametrize") else None
        for keyword in node.keywords if wanted else ():
            if keyword.arg != wanted:
                continue
            try:
                value = ast.literal_eval(keyword.value)
            except ValueError:
                raise AssertionError(f"{path.name}:{keyword.lineno}: {wanted}= is not a literal; the docs sync test "
                                     "reads case ids from the source") from None
            found.extend([value] if isinstance(value, str) else value)
    return found


def first_column_cells(markdown: str) -> list[tuple[int, str]]:
    """(line number, first cell) of every body row of every table: header and separator rows left out."""
    lines = markdown.splitlines()
    cells = []
    for number, line in enumerate(lines, 1):
        if not line.startswith("|"):
            continue
        cell = line.split("|")[1].strip()
        next_line = lines[number] if number < len(lines) else ""
        if set(cell) <= {"-", ":"} or re.match(r"^\|\s*:?-{3,}", next_line):
            continue
        cells.append((number, cell))
    return cells


def test_every_bad_input_case_has_a_row_and_every_row_is_a_case():
    ids = {}
    for name in CASE_FILES:
        for case in case_ids(REPO / "tests" / name):
            assert case not in ids, f"case id {case!r} in both {ids[case]} and {name}: a row could not say which"
            ids[case] = name
    assert len(ids) > 100  # the parser found the cases (123 when this test was written)

    rows = {}
    for number, cell in first_column_cells(DOC.read_text()):
        named = re.findall(r"`([^`]+)`", cell)
        assert named and re.fullmatch(r"(`[^`]+`[ ,]*)+", cell), f"docs/bad_inputs.md:{number}: first column " \
            f"{cell!r} is not a backticked case id"
        for case in named:
            assert case not in rows, f"docs/bad_inputs.md:{number}: case `{case}` also has a row at line {rows[case]}"
            rows[case] = number

    undocumented = sorted(f"{case} ({name})" for case, name in ids.items() if case not in rows)
    assert not undocumented, f"cases with no row in docs/bad_inputs.md: {undocumented}"
    unknown = sorted(f"{case} (line {rows[case]})" for case in rows if case not in ids)
    assert not unknown, f"rows of docs/bad_inputs.md that name no test case of {CASE_FILES}: {unknown}"
