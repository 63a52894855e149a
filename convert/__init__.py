"""Kimi K3 release <-> transformers checkpoint conversion (`kimik3 convert / export / verify`).

Public API: `convert`, `export`, `verify`, the CLI entries `run_convert`, `run_export`, `run_verify`
(argparse-style argument lists -> exit code), `cli_main`, `ConversionError`, and `fixture.write_release_checkpoint`.
"""

from .cli import cli_main, main_convert, main_export, main_verify, run_convert, run_export, run_verify
from .converter import convert
from .errors import ConversionError
from .exporter import export
from .verifier import verify

__all__ = [
    "ConversionError",
    "cli_main",
    "convert",
    "export",
    "main_convert",
    "main_export",
    "main_verify",
    "run_convert",
    "run_export",
    "run_verify",
    "verify",
]
