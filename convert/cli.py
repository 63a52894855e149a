"""Command-line entries. Each `run_*` takes an argparse-style argument list and returns an exit code:
0 success, 1 verification found mismatches, 2 bad input / usage (the message names the file and tensor)."""

import argparse
import json
import sys

from kimik3.arguments import positive_int

from .converter import DEFAULT_EXPERTS_FORMAT
from .errors import ConversionError
from .plan import STREAMED_FORMATS


def _convert_parser(prog: str = "kimik3 convert") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Convert a Kimi K3 release-layout checkpoint (folder or Hub "
                                "repo id) into the transformers layout of this package.")
    p.add_argument("src", help="release-layout folder, or a Hub repo id such as moonshotai/Kimi-K3")
    p.add_argument("dst", help="output folder (created; resumed if it holds an unfinished run of the same job)")
    p.add_argument("--revision", help="Hub revision (commit) when SRC is a repo id; pin one")
    p.add_argument("--text-only", action="store_true", help="write KimiK3ForCausalLM alone (no vision tensors)")
    p.add_argument("--experts-format", choices=STREAMED_FORMATS, default=DEFAULT_EXPERTS_FORMAT,
                   help="the config's experts_format, one of %(choices)s (default %(default)s): dense dequantises the "
                   "routed experts to bf16 (exact); mxfp4 keeps them packed")
    p.add_argument("--num-layers", type=positive_int, help="keep a prefix of N layers (re-scheduled to end with MLA)")
    p.add_argument("--num-experts", type=positive_int,
                   help="keep the first E experts with their router rows and biases")
    p.add_argument("--allow-unknown", action="store_true", help="skip tensor names the name map does not know")
    p.add_argument("--max-shard-size", default="5GB", help="output shard size limit (default 5GB)")
    p.add_argument("--overwrite", action="store_true", help="replace the checkpoint files already in DST")
    p.add_argument("--threads", type=positive_int, help="torch intra-op threads for dequantisation (default: torch's)")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    return p


def _export_parser(prog: str = "kimik3 export") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Export one of our checkpoints (converted or fine-tuned) to "
                                "the Kimi K3 release layout (experts re-quantised to MXFP4).")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--allow-unknown", action="store_true")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--threads", type=positive_int, help="torch intra-op threads for re-quantisation (default: torch's)")
    p.add_argument("--quiet", action="store_true")
    return p


def _verify_parser(prog: str = "kimik3 verify") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Compare two folders of one model (release, converted, "
                                "exported, fine-tuned or saved; either order), tensor by tensor and by the logits of a "
                                "short forward.")
    p.add_argument("src", help="a folder (or Hub repo id) in the release layout or ours")
    p.add_argument("converted", help="the other folder, in either layout")
    p.add_argument("--revision")
    p.add_argument("--logits", choices=("auto", "always", "never"), default="auto")
    p.add_argument("--tokens", type=positive_int, default=8)
    p.add_argument("--json", action="store_true", help="print the full report as JSON")
    return p


def _adopt_parser(prog: str = "kimik3 adopt") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Make a folder of kilobytes that loads a release-layout folder "
                                "(a Hub snapshot folder works) through our code with trust_remote_code: our config, "
                                "code and tokenizer files, and symlinks to the release's index and shards (nothing "
                                "is copied; the release folder is never written).")
    p.add_argument("src", help="the release-layout folder (its files stay where they are)")
    p.add_argument("dst", help="the folder to write (new, or an empty folder; outside SRC)")
    p.add_argument("--experts-format", choices=STREAMED_FORMATS, default=DEFAULT_EXPERTS_FORMAT,
                   help="the config's experts_format, one of %(choices)s (default %(default)s): dense dequantises the "
                   "routed experts to bf16 at load (exact); mxfp4 keeps them packed")
    return p


# The shell's code for a process stopped by SIGINT (128 + 2)
INTERRUPTED_EXIT_CODE = 130


def _run(parser: argparse.ArgumentParser, argv, action, resumable: bool = True) -> int:
    try:
        args = parser.parse_args(list(argv) if argv is not None else None)
    except SystemExit as exc:  # argparse exits on --help and on usage errors; callers want a code
        return int(exc.code or 0)
    try:
        return action(args)
    except (ConversionError, OSError) as exc:  # bad input, or a folder we may not read / write (the message names it)
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # Ctrl-C: the shard being written was removed and the finished ones are recorded (convert/engine.py)
        again = "; run the same command again to resume after the finished shards" if resumable else ""
        print(f"{parser.prog}: interrupted{again}", file=sys.stderr)
        return INTERRUPTED_EXIT_CODE


def _report_writes(prog: str, dst, summary: dict) -> bool:
    """Says what the run did not do; True when there was nothing to do."""
    for name in summary.get("kept", []):
        print(f"note: kept {name} in {dst} (kimik3 did not write it)")
    if summary.get("already_done"):
        print(f"{prog}: {dst} already holds this result (same source files and options); nothing to do")
    return summary.get("already_done", False)


def _do_convert(args) -> int:
    from .converter import convert

    summary = convert(
        args.src, args.dst, text_only=args.text_only, experts_format=args.experts_format,
        num_layers=args.num_layers,
        num_experts=args.num_experts, allow_unknown=args.allow_unknown, max_shard_size=args.max_shard_size,
        overwrite=args.overwrite, progress=not args.quiet, revision=args.revision, threads=args.threads,
    )
    if _report_writes("kimik3 convert", args.dst, summary):
        return 0
    print(f"converted {args.src} -> {args.dst}: {summary['shards']} shard(s), {summary['bytes'] / 1e9:.3f} GB, "
          f"{len(summary['skipped'])} already done, {summary['seconds']:.1f} s")
    for note in summary["provenance"]["notes"]:
        print(f"note: {note}")
    return 0


def _do_export(args) -> int:
    from .exporter import export

    summary = export(args.src, args.dst, overwrite=args.overwrite, progress=not args.quiet,
                     allow_unknown=args.allow_unknown, threads=args.threads)
    if _report_writes("kimik3 export", args.dst, summary):
        return 0
    err = summary["experts_roundtrip"]
    print(f"exported {args.src} -> {args.dst}: {summary['shards']} shard(s), {summary['bytes'] / 1e9:.3f} GB; "
          f"experts re-quantised: {err['experts_requantised']} ({err['experts_bit_exact']} bit-exact), relative RMS "
          f"error {err['relative_rms_error']:.3g}, max |error| {err['max_abs_error']:.3g}")
    for note in summary["notes"]:
        print(f"note: {note}")
    return 0


def _do_verify(args) -> int:
    from .verifier import verify

    report = verify(args.src, args.converted, logits=args.logits, tokens=args.tokens, revision=args.revision)
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    tensors = report["tensors"]
    print(f"tensors: {tensors['compared']} compared, {len(tensors['mismatches'])} mismatch(es)")
    if "values_equal_bytes_differ" in tensors:  # two folders of one layout, compared name by name
        why = tensors.get("values_equal_why", "MXFP4 experts re-quantised with another valid scale")
        print(f"  {tensors['bytes_equal']} bytes-equal, {tensors['values_equal_bytes_differ']} values-equal with "
              f"different bytes ({why})")
    requantised = tensors.get("requantised")
    if requantised:  # a fine-tune against its export: the exporter re-quantised the dense experts to MXFP4
        print(f"  {requantised['tensors']} routed-expert tensor(s) differ only by the export's MXFP4 re-quantisation "
              f"(relative RMS error {requantised['relative_rms']:.3g}, max |error| {requantised['max_abs_err']:.3g}): "
              "equal after the same round trip of the dense side")
    for m in tensors["mismatches"][:20]:
        print(f"  MISMATCH {m['tensor']} (source {m['source']}): {m['max_abs_diff']}")
    logits = report["logits"]
    if logits.get("skipped"):
        print(f"logits: skipped ({logits['skipped']})")
    else:
        through = " (the dense experts through the export's MXFP4 round trip)" if logits.get("experts_requantised") \
            else ""
        print(f"logits: {'equal' if logits.get('ok') else 'DIFFERENT'}{through} (max |diff| "
              f"{logits.get('max_abs_diff')})")
    return 0 if report["ok"] else 1


def _do_adopt(args) -> int:
    from .adopt import adopt

    summary = adopt(args.src, args.dst, experts_format=args.experts_format)
    print(f"adopted {args.src} -> {args.dst}: {summary['links']} link(s) into {summary['record']['release']}, "
          f"{len(summary['record']['written'])} file(s) written ({summary['bytes_written'] / 1e3:.1f} kB), experts "
          f"{args.experts_format}")
    for note in summary["record"]["notes"]:
        print(f"note: {note}")
    return 0


def run_adopt(argv=None) -> int:
    return _run(_adopt_parser(), argv, _do_adopt, resumable=False)


def run_convert(argv=None) -> int:
    return _run(_convert_parser(), argv, _do_convert)


def run_export(argv=None) -> int:
    return _run(_export_parser(), argv, _do_export)


def run_verify(argv=None) -> int:
    return _run(_verify_parser(), argv, _do_verify, resumable=False)
