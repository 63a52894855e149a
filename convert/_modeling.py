"""Finds the remote-code files (`modeling_kimik3/`) and the configuration data, installed or in a source tree.

The converter runs both from the installed package (`kimik3.modeling`, `kimik3.configuration`) and from a plain
checkout before `setup.py` exists, so every lookup tries the installed name first and falls back to the folder next
to this one.
"""

import importlib
import sys
import types
from pathlib import Path

_HERE = Path(__file__).resolve().parent
_LOCAL_PACKAGE = "_kimik3_local_modeling"


def modeling_dir() -> Path:
    """Folder holding the remote-code `.py` files that are copied flat into a converted checkpoint."""
    try:
        package = importlib.import_module("kimik3.modeling")
        return Path(package.__file__).resolve().parent
    except ImportError:
        return _HERE.parent / "modeling_kimik3"


def configuration_data_dir() -> Path:
    try:
        package = importlib.import_module("kimik3.configuration")
        if getattr(package, "__file__", None):
            return Path(package.__file__).resolve().parent
        return Path(list(package.__path__)[0])
    except ImportError:
        return _HERE.parent / "configuration"


def load_modeling_module(name: str) -> types.ModuleType:
    """`kimik3.modeling.<name>` when installed, else the file from the checkout, loaded as a package member so the
    remote-code files' relative imports between each other keep working."""
    try:
        return importlib.import_module(f"kimik3.modeling.{name}")
    except ImportError:
        pass
    if _LOCAL_PACKAGE not in sys.modules:
        package = types.ModuleType(_LOCAL_PACKAGE)
        package.__path__ = [str(_HERE.parent / "modeling_kimik3")]
        sys.modules[_LOCAL_PACKAGE] = package
    return importlib.import_module(f"{_LOCAL_PACKAGE}.{name}")


def config_module():
    return load_modeling_module("configuration_kimi_k3")


def ops_module():
    return load_modeling_module("ops_kimi_k3")
