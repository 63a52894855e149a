"""Kimi K3 release <-> transformers checkpoint conversion (`kimik3 convert / export / verify`).

Public API: `convert`, `export`, `verify`, the `kimik3` CLI's entries `run_convert`, `run_export`, `run_verify`
(argparse-style argument lists -> exit code), `ConversionError`; `testing.write_release_checkpoint` writes a tiny
release-layout checkpoint for tests and demos.
"""

from .cli import run_convert, run_export, run_verify
from .converter import convert
from .errors import ConversionError
from .exporter import export
from .verifier import verify

__all__ = ["ConversionError", "convert", "export", "run_convert", "run_export", "run_verify", "verify"]
