"""Nothing in the checkout shadows a package of the stack: Python started in the repository root puts the root first
on sys.path, where a folder with an `__init__.py` or a module would be imported in place of an installed package of
the same name (transformers 5.25 imports PyPI's `kernels` when a model loads). The design card's `kernels/` folder has
no `__init__.py`; `kimik3.kernels` is `kimik3/kernels.py`, whose `__path__` names the folder, in a checkout and in a
wheel alike. (Python started in the root importing transformers' hub kernels: tests/test_readme.py.)"""

import importlib.metadata
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def importable_top_level_names(root: Path) -> set[str]:
    """What `import NAME` finds in `root` before site-packages: packages (folders with an `__init__.py`) and modules."""
    names = {path.parent.name for path in root.glob("*/__init__.py")}
    return names | {path.stem for path in root.glob("*.py")}


def test_no_top_level_name_of_the_checkout_is_an_installed_distributions():
    installed = importlib.metadata.packages_distributions()
    clashes = {name: installed[name] for name in importable_top_level_names(ROOT)
               if name in installed and set(installed[name]) != {"kimik3"}}
    assert not clashes, f"these checkout names stand in for installed packages in Python started in the root: {clashes}"
    # the design card's folder is there, as files of kimik3.kernels, and is no package of its own
    assert (ROOT / "kernels" / "_base.py").is_file() and not (ROOT / "kernels" / "__init__.py").exists()
    assert "kernels" not in importable_top_level_names(ROOT)


def test_the_check_sees_a_shadowing_folder(tmp_path):
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("")
    (tmp_path / "transformers.py").write_text("")
    assert {"kernels", "transformers"} <= importable_top_level_names(tmp_path)


def test_kimik3_kernels_finds_its_files_in_a_wheels_layout(tmp_path):
    """A wheel installs kimik3/kernels.py beside kimik3/kernels/ (setup.py maps the folder there); the module's
    `__path__` is then that folder, never site-packages' `kernels` beside `kimik3/`."""
    package = tmp_path / "kimik3"
    shutil.copytree(ROOT / "kernels", package / "kernels", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "kimik3" / "__init__.py", package / "__init__.py")
    shutil.copy(ROOT / "kimik3" / "kernels.py", package / "kernels.py")
    (tmp_path / "kernels").mkdir()  # a stand-in for PyPI's kernels beside the package, as in site-packages
    (tmp_path / "kernels" / "_base.py").write_text("")
    code = ("import importlib.util, sys\n"
            "import kimik3.kernels as k\n"
            "print(k.__path__[0])\n"
            "print(importlib.util.find_spec('kimik3.kernels.mxfp4').origin)\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    path, origin = result.stdout.split()
    assert Path(path) == package / "kernels" and Path(origin) == package / "kernels" / "mxfp4.py"
