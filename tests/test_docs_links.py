"""What the docs cite is there, and what is there is cited: every `benchmarks/results/...` file and `docs/...md` page
that README.md and docs/*.md name exists, every file kept in benchmarks/results/ is cited by one of them (the folder
keeps evidence, not a lab notebook), a raw file removed from the tree is cited with the commit that holds it
(`COMMIT:benchmarks/results/NAME`, checked against git where the commit is there), and no code comment outside tests/
names a measurement session or round, or a section of a reference file a user does not have (comments cite
docs/architecture.md or docs/benchmarks.md by section name). Reads files only (and git's listing of a commit): no
package import."""

import ast
import fnmatch
import io
import re
import shutil
import subprocess
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# A result file is cited by its name, by a shortened name the history uses (`..._run17_x.json`, `run11.log`,
# `run10_moe_few_rows`), or by a pattern naming its run (`h200_gpu_tests_run19_*.log`, `..._run{1,2,3}_*.json`).
# A pattern without a run number (`h200_gpu_tests_run*.log`) says where logs live and cites none of them.
RESULT_TOKEN = re.compile(r"^(?:(?:h100|h200|cpu_)[\w.{},*-]*|_?run\d[\w.{},*-]*)$")
# A raw file removed from the tree is cited with the commit that still holds it: `a90b3e9:benchmarks/results/NAME`
# (what `git show` takes). Such a citation names git history, not the tree, and is no result token.
HISTORY_CITATION = re.compile(r"\b([0-9a-f]{7,40}):benchmarks/results/([\w.{},*-]+\w)")
TREE_CITATION = re.compile(r"(?<![0-9a-f]:)benchmarks/results/([\w.{},*-]+\w)")
ROUND = re.compile(r"\b(?:session|round|run)s? ?#?\d+", re.IGNORECASE)
OUTSIDE_REFERENCE = re.compile(
    r"§|k3_math|k3_checkpoint|kernels_perf|peers_users|transformers_v5|shared/reference"
    # a bare section number in brackets, "(6.4)", "(2.2 step 3)", "(5.1, 7)": a section of a file not in the tree
    r"|\((?:\d+\.)+\d+(?: step \d+)?(?:, \d+(?:\.\d+)*)*\)")


def _without_fences(text: str) -> str:
    """Fenced code blocks are commands: their `--out` paths are outputs, not citations."""
    return re.sub(r"^```.*?^```", "", text, flags=re.DOTALL | re.MULTILINE)


def _tree_citations(text: str) -> list[str]:
    """The `benchmarks/results/NAME` paths of the prose: files the tree must hold."""
    return TREE_CITATION.findall(_without_fences(text))


def _history_citations(text: str) -> list[tuple[str, str]]:
    """(commit, NAME) of the prose's `COMMIT:benchmarks/results/NAME`: files that commit must hold."""
    return HISTORY_CITATION.findall(_without_fences(text))


def _result_tokens(text: str) -> list[str]:
    tokens = []
    for span in re.findall(r"`([^`]+)`", _without_fences(text)):
        for word in re.split(r"[\s,;()+]+(?![^{]*\})", span):
            word = word.removeprefix("benchmarks/").removeprefix("results/").removeprefix("...")
            if RESULT_TOKEN.match(word):
                tokens.append(word)
    return tokens


def _expand_braces(token: str) -> list[str]:
    match = re.search(r"\{([^{}]*)\}", token)
    if not match:
        return [token]
    return [expanded for part in match.group(1).split(",")
            for expanded in _expand_braces(token[:match.start()] + part + token[match.end():])]


def _cites(token: str, name: str) -> bool:
    for pattern in _expand_braces(token):
        if "*" in pattern:
            if re.search(r"run\d", pattern) and fnmatch.fnmatchcase(name, pattern if pattern.startswith("h200")
                                                                     else "*_" + pattern.lstrip("_")):
                return True
            continue
        tail = "_" + pattern.lstrip("_")
        if name == pattern or name.endswith(tail) or name.rsplit(".", 1)[0].endswith(tail):
            return True
    return False


def _doc_texts() -> dict[str, str]:
    return {path.relative_to(ROOT).as_posix(): path.read_text(encoding="utf-8") for path in DOCS}


def _results_files() -> list[str]:
    return sorted(p.name for p in RESULTS.iterdir() if p.name != "README.md")


def test_every_cited_results_file_and_doc_page_exists():
    names = _results_files()
    missing = []
    for doc, text in _doc_texts().items():
        prose = _without_fences(text)
        for path in _tree_citations(text):
            if not any(fnmatch.fnmatchcase(n, p) for p in _expand_braces(path) for n in [*names, "README.md"]):
                missing.append(f"{doc}: benchmarks/results/{path}")
        for token in _result_tokens(text):
            if not any(_cites(token, n) or fnmatch.fnmatchcase(n, token) for n in names):
                missing.append(f"{doc}: {token}")
        for page in re.findall(r"\b(docs/[\w/.-]+\.md)\b", prose):
            if not (ROOT / page).is_file():
                missing.append(f"{doc}: {page}")
        for link in re.findall(r"\]\(([\w./-]+\.md)(?:#[\w-]+)?\)", prose):
            if not (ROOT / doc).parent.joinpath(link).resolve().is_file():
                missing.append(f"{doc}: link {link}")
    assert not missing, "cited but not in the tree:\n" + "\n".join(missing)


def test_every_results_file_is_cited_and_listed():
    tokens = [token for text in _doc_texts().values() for token in _result_tokens(text)]
    uncited = [name for name in _results_files() if not any(_cites(token, name) for token in tokens)]
    assert not uncited, f"benchmarks/results/ files no doc cites: {uncited}"
    listing = (RESULTS / "README.md").read_text(encoding="utf-8")
    unlisted = [name for name in _results_files() if f"`{name}`" not in listing]
    assert not unlisted, f"benchmarks/results/README.md does not list: {unlisted}"


@pytest.mark.parametrize("token, name, cited", [
    pytest.param("h200_bench_k3_run1.json", "h200_bench_k3_run1.json", True, id="results-cite-full-name"),
    pytest.param("_run17_ptx_global_error.json", "h200_bench_k3_run17_ptx_global_error.json", True,
                 id="results-cite-elided-prefix"),
    pytest.param("run10_moe_few_rows", "h200_bench_k3_run10_moe_few_rows.json", True, id="results-cite-stem"),
    pytest.param("run1.log", "h200_gpu_tests_run11.log", False, id="results-cite-not-a-prefix-of-a-number"),
    pytest.param("h200_gpu_tests_run19_*.log", "h200_gpu_tests_run19_mxfp4_gemv.log", True,
                 id="results-cite-pattern-with-run"),
    pytest.param("h200_gpu_tests_run*.log", "h200_gpu_tests_run2.log", False, id="results-cite-pattern-without-run"),
    pytest.param("h200_diagnose_mxfp4_gemv_run{1,2,3}_*.json", "h200_diagnose_mxfp4_gemv_run2_vector_x.json", True,
                 id="results-cite-braces"),
])
def test_citation_forms(token, name, cited):
    assert _cites(token, name) is cited


@pytest.mark.parametrize("text, tree, history, tokens", [
    pytest.param("(`benchmarks/results/h200_bench_k3_run1.json`)", ["h200_bench_k3_run1.json"], [],
                 ["h200_bench_k3_run1.json"], id="tree-path-in-backticks"),
    pytest.param("its log, benchmarks/results/h200_gpu_tests_run11.log, shows", ["h200_gpu_tests_run11.log"], [], [],
                 id="tree-path-in-prose"),
    pytest.param("(raw file removed; `a90b3e9:benchmarks/results/h200_bench_k3_run2_decode.json`)", [],
                 [("a90b3e9", "h200_bench_k3_run2_decode.json")], [], id="history-citation"),
    pytest.param("`a90b3e9:benchmarks/results/h200_gpu_tests_run19_*.log`", [],
                 [("a90b3e9", "h200_gpu_tests_run19_*.log")], [], id="history-citation-pattern"),
    pytest.param("```text\ngit show a90b3e9:benchmarks/results/h200_x.json\n```\n", [], [], [],
                 id="history-citation-in-a-fence-is-a-command"),
])
def test_tree_and_history_citation_forms(text, tree, history, tokens):
    assert _tree_citations(text) == tree
    assert _history_citations(text) == history
    assert _result_tokens(text) == tokens


def _files_at(commit: str) -> list[str] | None:
    """The names under benchmarks/results/ at a commit, or None where git or the commit is not there (an archive,
    a shallow clone)."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        return None
    listing = subprocess.run(["git", "ls-tree", "--name-only", f"{commit}:benchmarks/results/"], cwd=ROOT,
                             capture_output=True, text=True)
    return listing.stdout.split() if listing.returncode == 0 else None


def test_history_citations_name_files_at_their_commit():
    cited = {(doc, commit, name) for doc, text in _doc_texts().items() for commit, name in _history_citations(text)}
    if not cited:
        pytest.skip("no doc cites a raw file by commit")
    listings = {commit: _files_at(commit) for _, commit, _ in cited}
    checked = [(doc, commit, name) for doc, commit, name in sorted(cited) if listings[commit] is not None]
    if not checked:
        pytest.skip("git history of the cited commits is not in this checkout")
    missing = [f"{doc}: {commit}:benchmarks/results/{name}" for doc, commit, name in checked
               if not any(fnmatch.fnmatchcase(n, p) for p in _expand_braces(name) for n in listings[commit])]
    assert not missing, "cited at a commit that does not hold it:\n" + "\n".join(missing)


def _comments_and_docstrings(path: Path):
    source = path.read_text(encoding="utf-8")
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = node.body[0] if node.body else None
            if isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str):
                for offset, line in enumerate(doc.value.value.splitlines()):
                    yield doc.lineno + offset, line


def _comment_problems(path: Path, label: str) -> list[str]:
    problems = []
    for line_number, text in _comments_and_docstrings(path):
        prose = re.sub(r"`[^`]*`", "", text)  # a backticked name is code (a JSON key, a function), not a citation
        for pattern, what in ((ROUND, "a measurement round"), (OUTSIDE_REFERENCE, "a file outside the repository")):
            if pattern.search(prose):
                problems.append(f"{label}:{line_number} names {what}: {text.strip()}")
    return problems


def test_code_comments_cite_what_a_user_has():
    problems = []
    for path in sorted(ROOT.rglob("*.py")):
        relative = path.relative_to(ROOT)
        # the project's files: not the tests, build outputs, or hidden folders (.git, a user's or CI's .venv*)
        if relative.parts[0] in ("tests", "build") or any(p.endswith(".egg-info") or p.startswith(".")
                                                          for p in relative.parts[:-1]):
            continue
        problems += _comment_problems(path, relative.as_posix())
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("line, bad", [
    pytest.param("# measured in session 12 (docs/benchmarks.md)", True, id="comment-names-session"),
    pytest.param("# H200 runs 24-25", True, id="comment-names-run"),
    pytest.param("# softmax in f32 (6.4)", True, id="comment-bare-section-number"),
    pytest.param("# see k3_math.md 10", True, id="comment-names-reference-file"),
    pytest.param("# the `session11` key of the JSON", False, id="comment-backticked-name"),
    pytest.param("# (docs/architecture.md, Stable LatentMoE); 0.5 -> [-1, 1] (1.0 is balanced)", False,
                 id="comment-plain-numbers"),
])
def test_comment_check_itself(tmp_path, line, bad):
    path = tmp_path / "m.py"
    path.write_text(f"x = 1  {line}\n", encoding="utf-8")
    assert bool(_comment_problems(path, "m.py")) is bad
