"""Makes `kimik3.convert` importable from a plain checkout (before setup.py / `pip install -e .` exist).

When the package is installed this does nothing. Otherwise it registers `kimik3` (the repo's `kimik3/` folder, if any)
and maps `kimik3.convert` onto the repo's `convert/` folder, as setup.py's package_dir mapping will.
"""

import importlib
import importlib.util
import sys
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def ensure_kimik3_convert():
    try:
        return importlib.import_module("kimik3.convert")
    except ImportError:
        pass
    for name in [n for n in sys.modules if n == "kimik3" or n.startswith("kimik3.")]:
        del sys.modules[name]
    root = types.ModuleType("kimik3")
    root.__path__ = [str(REPO / "kimik3")]
    sys.modules["kimik3"] = root
    spec = importlib.util.spec_from_file_location(
        "kimik3.convert", REPO / "convert" / "__init__.py", submodule_search_locations=[str(REPO / "convert")]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["kimik3.convert"] = module
    spec.loader.exec_module(module)
    root.convert = module
    return module


def subprocess_env() -> dict:
    """Environment for `python -c` subprocesses that import kimik3.convert the same way."""
    import os

    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO / "tests") + os.pathsep + env.get("PYTHONPATH", "")
    return env
