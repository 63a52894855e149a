"""The `kimik3` command: parses arguments, calls the library (kimik3.tiny, kimik3.memory, kimik3.demo,
kimik3.chat, kimik3.convert) and prints."""

import argparse
import json
import sys

from kimik3.arguments import (bandwidth, context_tokens, gpu_memory_size, milliseconds, positive_int, text_config_file,
                              token_counts)


PLAN_ONLY_OPTIONS = ("gpus", "gpu_mem", "experts_format", "context", "nodes", "gpus_per_node", "tp", "ep",
                     "prefill_chunk", "hbm_bandwidth", "experts_offload", "host_mem", "experts_cache", "h2d_bandwidth",
                     "disk_bandwidth", "experts_compute", "measure", "host_bandwidth", "piecewise_layer_ms",
                     "host_route_ms", "stream_layer_ms")
# the options of the offload tiers' plan, which need --experts-offload
OFFLOAD_PLAN_OPTIONS = ("host_mem", "experts_cache", "h2d_bandwidth", "disk_bandwidth", "experts_compute", "measure",
                        "host_bandwidth", "piecewise_layer_ms", "host_route_ms", "stream_layer_ms")
# the options that ask for the per-rank plan of a parallel layout instead of the one-process layer split
PARALLEL_PLAN_OPTIONS = ("nodes", "gpus_per_node", "tp", "ep", "prefill_chunk", "hbm_bandwidth")


def cmd_tiny(args) -> int:
    from kimik3.demo import progress_bars_off
    from kimik3.tiny import TinyFolderError, write_tiny_folder

    try:
        with progress_bars_off():
            model, kept = write_tiny_folder(args.directory, args.layers, seed=args.seed, overwrite=args.overwrite,
                                            vision=args.vision)
    except TinyFolderError as exc:
        print(f"kimik3 tiny: error: {exc}", file=sys.stderr)
        return 2
    for name in kept:
        print(f"note: kept {name} in {args.directory} (not a file kimik3 tiny writes)")
    print(f"wrote a tiny random Kimi K3 ({sum(p.numel() for p in model.parameters()):,} parameters, "
          f"{args.layers} layers) to {args.directory}")
    return 0


def cmd_memory(args) -> int:
    from kimik3.memory import (RECONCILE_TOKENS, UNIT_WORDS, auto_unit, describe_layers, format_memory_table,
                               format_reconciliation, format_snapshot_memory, load_text_config, memory_table,
                               reconcile_quoted, snapshot_memory)

    def usage_error(message: str) -> int:
        print(f"kimik3 memory: error: {message}", file=sys.stderr)
        return 2

    config = args.config if args.config is not None else load_text_config()
    if args.plan:
        return _memory_plan(args, config, usage_error)
    given = [name for name in PLAN_ONLY_OPTIONS if getattr(args, name) is not None]
    if given:
        return usage_error(f"argument --{given[0].replace('_', '-')}: only with --plan")
    if args.reconcile and args.config is not None:
        return usage_error("argument --reconcile: the quoted figures are for the released model; drop --config")
    tokens = args.tokens or (list(RECONCILE_TOKENS) if args.reconcile else [131072, 1048576])
    state_dtype = args.state_dtype or ("bfloat16" if args.reconcile else "float32")
    rows = memory_table(config, tokens, args.batch, state_dtype=state_dtype)
    quoted = reconcile_quoted(config) if args.reconcile else None
    if args.json:  # nothing but the JSON, so it can be piped
        print(json.dumps(rows if quoted is None else {"rows": rows, "reconciliation": quoted}))
        return 0
    unit = args.units or ("GB" if args.reconcile else auto_unit(rows))
    print(f"Cache memory, {describe_layers(config)}, bf16 activations, {state_dtype} KDA state "
          f"({'the model keeps it in float32' if state_dtype != 'float32' else 'as the model keeps it'}); "
          f"1 {unit} = {UNIT_WORDS[unit]}")
    print(format_memory_table(rows, unit))
    if quoted is not None:
        print()
        print(format_reconciliation(quoted))
    snapshots = snapshot_memory(config, tokens, args.snapshot_blocks, args.batch)
    print()
    print(f"KDA state snapshots for prefix reuse, one every {snapshots[0]['interval_tokens']} tokens")
    print(format_snapshot_memory(snapshots, unit))
    return 0


def _memory_plan(args, config, usage_error) -> int:
    from kimik3.memory import device_plan, format_device_plan

    parallel = any(getattr(args, name) is not None for name in PARALLEL_PLAN_OPTIONS)
    if args.gpus is not None and args.gpus_per_node is not None and args.gpus != args.gpus_per_node * (args.nodes or 1):
        return usage_error(f"argument --gpus: {args.gpus} contradicts --nodes {args.nodes or 1} x --gpus-per-node "
                           f"{args.gpus_per_node}; give one of them")
    if args.gpus is not None and args.nodes is not None and args.gpus_per_node is None:
        return usage_error("argument --gpus: with --nodes, give --gpus-per-node (--gpus is one node's count)")
    if args.gpus is None and args.gpus_per_node is None:
        return usage_error("argument --plan: needs --gpus (e.g. --gpus 8) or --gpus-per-node (e.g. --nodes 2 "
                           "--gpus-per-node 8)")
    if args.gpu_mem is None:
        return usage_error("argument --plan: needs --gpu-mem (e.g. --gpu-mem 141GB)")
    from kimik3.memory import MAX_PLAN_DEVICES

    devices = (args.nodes or 1) * (args.gpus_per_node or 1) if args.gpus is None else args.gpus
    if devices > MAX_PLAN_DEVICES:
        return usage_error(f"argument --plan: {devices:,} devices is more than the {MAX_PLAN_DEVICES:,} a plan covers "
                           "(the release spreads over 16 H200s; --gpus, --nodes x --gpus-per-node)")
    context = args.context if args.context is not None else config.max_position_embeddings
    if context > config.max_position_embeddings:
        return usage_error(f"argument --context: {context:,} tokens is more than the model's "
                           f"max_position_embeddings ({config.max_position_embeddings:,})")
    gpu_memory, unit = args.gpu_mem
    if args.experts_offload is not None:
        return _offload_plan(args, config, context, gpu_memory, unit, usage_error)
    given = [name for name in OFFLOAD_PLAN_OPTIONS if getattr(args, name) is not None]
    if given:
        return usage_error(f"argument --{given[0].replace('_', '-')}: only with --experts-offload")
    if parallel:
        return _parallel_plan(args, config, context, gpu_memory, unit, usage_error)
    plan = device_plan(config, args.gpus, gpu_memory, context, args.batch, args.experts_format)
    return _print_plan(args, plan, lambda: format_device_plan(plan, config, unit=unit))


def _offload_plan(args, config, context, gpu_memory, unit, usage_error) -> int:
    from kimik3.memory import PlanError, format_offload_plan, offload_plan

    # as the load refuses experts_offload with tp_plan / distributed_config: the offload keeps one device's experts
    for name in ("tp", "ep", "nodes", "gpus_per_node", "gpus"):
        if (getattr(args, name) or 1) > 1:
            return usage_error(f"argument --{name.replace('_', '-')}: {getattr(args, name)} with --experts-offload: "
                               "the offload keeps the routed experts of one GPU in its host's memory; tensor/expert "
                               "parallelism and several devices are not supported with it (plan one GPU: --gpus 1)")
    if args.host_mem is None and args.experts_offload != "disk":  # disk: no page cache counted without it
        return usage_error("argument --experts-offload: needs --host-mem (e.g. --host-mem 1500GB)")
    if args.disk_bandwidth is not None and args.experts_offload != "disk":
        return usage_error("argument --disk-bandwidth: only with --experts-offload disk")
    rates = {}
    if args.measure:
        from kimik3.memory import measure_rates

        measured = measure_rates(config, experts_format=args.experts_format)
        rates = {"host_bytes_per_s": measured["host_bytes_per_s"], "host_flops": measured["host_flops"],
                 "measured": measured}
        if measured["h2d_bandwidth"] and args.h2d_bandwidth is None:
            rates["h2d_bandwidth"] = measured["h2d_bandwidth"]
    if args.host_bandwidth is not None:
        # the plan is for a host of this DRAM bandwidth: the kernel at the fraction of it measured here (or assumed)
        from kimik3.memory import HOST_KERNEL_FRACTION_ASSUMED

        measured = rates.get("measured")
        fraction = (measured["host_bytes_per_s"] / measured["dram_read_bytes_per_s"] if measured
                    else HOST_KERNEL_FRACTION_ASSUMED)
        rates["host_bytes_per_s"] = fraction * args.host_bandwidth
        rates.setdefault("measured", {})["for_host_bandwidth"] = {"dram_read_bytes_per_s": args.host_bandwidth,
                                                                  "kernel_fraction": fraction,
                                                                  "fraction_measured": bool(measured)}
    try:
        plan = offload_plan(config, gpu_memory, args.host_mem[0] if args.host_mem else 0, context, args.batch,
                            experts_format=args.experts_format,
                            experts_cache=args.experts_cache and args.experts_cache[0], mode=args.experts_offload,
                            experts_compute=args.experts_compute or "device", **rates,
                            **{name: value for name, value in (("piecewise_layer_s", args.piecewise_layer_ms),
                                                               ("host_route_s", args.host_route_ms),
                                                               ("stream_layer_s", args.stream_layer_ms))
                               if value is not None},
                            **_given(args, "prefill_chunk", "h2d_bandwidth", "hbm_bandwidth", "disk_bandwidth"))
    except PlanError as exc:
        return usage_error(str(exc))
    return _print_plan(args, plan, lambda: format_offload_plan(plan, config, unit=unit))


def _parallel_plan(args, config, context, gpu_memory, unit, usage_error) -> int:
    from kimik3.memory import PlanError, check_degrees, format_parallel_plan, parallel_plan, search_degrees

    nodes = args.nodes or 1
    per_node = args.gpus_per_node if args.gpus_per_node is not None else args.gpus
    options = dict(batch_size=args.batch, experts_format=args.experts_format,
                   **_given(args, "prefill_chunk", "hbm_bandwidth"))
    try:
        if args.tp is not None and args.ep is not None:
            plan, searched = parallel_plan(config, nodes, per_node, gpu_memory, args.tp, args.ep, context,
                                           **options), None
        else:
            plan, candidates = search_degrees(config, nodes, per_node, gpu_memory, context, tp=args.tp, ep=args.ep,
                                              **options)
            if plan is None:  # every candidate refused: say why for the degree given (or tp = ep = 1)
                check_degrees(config, nodes * per_node, args.tp or 1, args.ep or 1)
                raise PlanError("argument --plan: no tp/ep layout of this world size passes the product rules")
            searched = len(candidates)
    except PlanError as exc:
        return usage_error(str(exc))
    return _print_plan(args, plan, lambda: format_parallel_plan(plan, config, unit=unit, chosen_from=searched))


def _given(args, *names) -> dict:
    """The plan options the user gave (the library's defaults stand for the others)."""
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


def _print_plan(args, plan: dict, text) -> int:
    if args.json:  # nothing but the JSON, so it can be piped
        print(json.dumps(plan))
    else:
        print(text())
    return 0


def cmd_demo(args) -> int:
    from kimik3.demo import run_demo

    return 0 if run_demo(args.new_tokens) else 1


class RemoteCodeConstant:
    """A constant of the remote code (`kimik3.modeling.<module>.<name>`), read when first used: as argparse
    `choices` (a tuple) or in a help text through `%(...)s` (a string). Importing the remote code loads transformers;
    give the option a `metavar`, or argparse lists the choices (and imports) while the parser is built."""

    def __init__(self, module: str, name: str):
        self.module, self.name = module, name

    def value(self):
        import importlib

        return getattr(importlib.import_module(f"kimik3.modeling.{self.module}"), self.name)

    def __contains__(self, item) -> bool:
        return item in self.value()

    def __iter__(self):
        return iter(self.value())

    def __str__(self) -> str:
        return str(self.value())


class TemplateReasoningEfforts:
    """argparse choices of --reasoning-effort: the chat format's own list (kimik3.chat_format.REASONING_EFFORTS, the
    values its renderer and the Jinja template accept), read when first needed: importing it loads transformers, and
    the parser stays quick to build."""

    def _values(self) -> tuple[str, ...]:
        from kimik3.chat_format import REASONING_EFFORTS

        return REASONING_EFFORTS

    def __contains__(self, value) -> bool:
        return value in self._values()

    def __iter__(self):
        return iter(self._values())


def cmd_serve(args) -> int:
    try:
        from kimik3.serve import run
        import fastapi, uvicorn  # noqa: F401, E401 - the serve extra
    except ImportError as exc:
        print(f"kimik3 serve: error: {exc.name} is not installed: pip install 'kimik3[serve]' (fastapi and "
              "uvicorn)", file=sys.stderr)
        return 1
    return run(args)


def cmd_chat(args) -> int:
    from kimik3.chat import ChatFolderError, ChatInputError, read_prompt_file, run_chat

    try:
        prompt = read_prompt_file(args.prompt_file) if args.prompt_file is not None else args.prompt
        run_chat(args.directory, prompt, args.max_new_tokens, args.reasoning_effort, system=args.system,
                 tools_file=args.tools, image=args.image,
                 **({} if args.prefill_chunk_size is None else {"prefill_chunk_size": args.prefill_chunk_size}))
    except (ChatFolderError, ChatInputError) as exc:
        print(f"kimik3 chat: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nkimik3 chat: interrupted", file=sys.stderr)
        return 130
    return 0


PASSTHROUGH_HELP = {
    "convert": "the released checkpoint (Hub id or folder) -> a folder that loads with trust_remote_code",
    "adopt": "a release folder -> a folder of kilobytes that loads it as it is with trust_remote_code (links, no copy)",
    "export": "one of our folders (e.g. a fine-tune) -> the release layout (MXFP4 experts)",
    "verify": "compare a converted or exported folder with its source, tensor by tensor and by logits",
}


def main(argv: list[str] | None = None) -> int:
    from kimik3.memory import UNITS  # standard library only: the parser stays quick to build
    parser = argparse.ArgumentParser(
        prog="kimik3", description="Kimi K3 for Hugging Face transformers. `kimik3 COMMAND --help` lists the options "
                                   "of each command.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("tiny", help="write a small random K3 model folder loadable with trust_remote_code",
                       description="Write a small random Kimi K3 (weights, config with auto_map, the code files, a "
                                   "tokenizer) that AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True) "
                                   "loads in a fresh process.")
    p.add_argument("directory", help="the folder to write (created if missing)")
    p.add_argument("--layers", type=positive_int, default=4,
                   help="decoder layers, on the release's schedule (every 4th is MLA; default 4)")
    p.add_argument("--overwrite", action="store_true", help="replace the model files of a non-empty folder")
    p.add_argument("--seed", type=int, default=0, help="random seed of the weights (default 0)")
    p.add_argument("--vision", action="store_true",
                   help="the composite model with a small vision tower (images through AutoProcessor)")
    p.set_defaults(fn=cmd_tiny)

    p = sub.add_parser("memory", help="cache memory table: K3 vs all-MLA vs expanded K/V; with --plan, whether the "
                                      "model fits on N devices",
                       description="Cache bytes per sequence from the config alone: K3's hybrid cache (MLA latents, "
                                   "KDA states and conv windows) against the same depth all-MLA and the official "
                                   "code's expanded K/V. With --plan: weights + cache per device for a layer-wise "
                                   "split.")
    p.add_argument("--config", type=text_config_file,
                   help="config.json (released top-level or text config); default: the release")
    p.add_argument("--tokens", type=token_counts,
                   help="comma-separated context lengths (default: 131072,1048576; with --reconcile: "
                        "128000,1000000,1048576)")
    p.add_argument("--batch", type=positive_int, default=1, help="sequences (default 1)")
    p.add_argument("--units", choices=tuple(UNITS),
                   help="GB/MB/kB = 10^9/10^6/10^3 bytes, GiB/MiB/KiB = 2^30/2^20/2^10 bytes (default: GiB, or MiB/KiB "
                        "when GiB would show a small model's figures as zeros; GB with --reconcile)")
    p.add_argument("--state-dtype", choices=("float32", "bfloat16"),
                   help="KDA state dtype to count (default float32, what the model keeps; bfloat16 with --reconcile)")
    p.add_argument("--reconcile", action="store_true",
                   help="recompute the figures quoted for K3 elsewhere (KDA state 0.22 GB, MLA 3.5/29 GB, all-MLA "
                        "13.7/107 GB) with their token counts, decimal GB and a bf16 state, one line each")
    p.add_argument("--json", action="store_true", help="print only JSON (the table's rows, or the plan)")
    p.add_argument("--snapshot-blocks", type=positive_int,
                   help="KDA state snapshot spacing in 512-token blocks for the snapshot table (default: 40)")
    p.add_argument("--plan", action="store_true",
                   help="weights + cache per device for a layer-wise split over --gpus devices of --gpu-mem each")
    p.add_argument("--gpus", type=positive_int, help="with --plan: number of devices (one node)")
    p.add_argument("--nodes", type=positive_int,
                   help="with --plan: nodes (with --gpus-per-node); any parallel option gives the per-rank plan")
    p.add_argument("--gpus-per-node", type=positive_int, help="with --plan: devices a node")
    p.add_argument("--tp", type=positive_int,
                   help="with --plan: tensor-parallel degree (attention by head, dense MLPs by width; default: "
                        "searched)")
    p.add_argument("--ep", type=positive_int,
                   help="with --plan: expert-parallel degree, ranks holding distinct whole experts, 1 or a multiple "
                        "of --tp (default: searched)")
    p.add_argument("--prefill-chunk", type=context_tokens,
                   help="with --plan: prompt tokens a prefill forward, for the workspace (default 8192)")
    p.add_argument("--hbm-bandwidth", type=bandwidth,
                   help="with --plan: HBM bytes/s for the decode bound, e.g. 4.8TB/s (default: the H200's "
                        "specification, 4.8 TB/s; docs/benchmarks.md measures 4.3 TB/s copies)")
    p.add_argument("--gpu-mem", type=gpu_memory_size,
                   help="with --plan: memory per device, e.g. 141GB (10^9 bytes) or 141GiB (2^30 bytes)")
    experts = p.add_argument(
        "--experts-format", choices=RemoteCodeConstant("configuration_kimi_k3", "EXPERTS_FORMATS"), metavar="FORMAT",
        help="with --plan: how the routed experts are stored, one of %(choices)s, as the config's experts_format "
             "(mxfp4: packed, 4.25 bits per value; dense: bf16); default %(release_format)s, the release's own")
    experts.release_format = RemoteCodeConstant("configuration_kimi_k3", "RELEASE_EXPERTS_FORMAT")  # for the help
    p.add_argument("--experts-offload", choices=RemoteCodeConstant("offload_kimi_k3", "EXPERTS_OFFLOAD_MODES"),
                   metavar="MODE",
                   help="with --plan: the routed experts kept off the GPU as the load option experts_offload (host: "
                        "in host memory; disk: mapped from the shards), the rest on one GPU, with a device expert cache")
    p.add_argument("--host-mem", type=gpu_memory_size,
                   help="with --experts-offload: host memory for the routed experts, e.g. 1500GB (disk: what the page "
                        "cache may keep of them, default none)")
    p.add_argument("--experts-cache", type=gpu_memory_size,
                   help="with --experts-offload: the device's expert cache (experts_cache_bytes), e.g. 10GB "
                        "(default: what is left on the GPU after the rest)")
    p.add_argument("--h2d-bandwidth", type=bandwidth,
                   help="with --experts-offload: host-to-device bytes/s, e.g. 55GB/s (default: 50 GB/s, an "
                        "assumption for PCIe 5.0 x16, not a measurement: measure yours)")
    p.add_argument("--experts-compute", choices=RemoteCodeConstant("offload_kimi_k3", "EXPERTS_COMPUTE_MODES"),
                   metavar="WHERE",
                   help="with --experts-offload: where the chosen experts the GPU lacks are computed, as the load "
                        "option experts_compute, one of %(choices)s (device: copied; host: on the CPU; auto: the "
                        "faster per forward); default device")
    p.add_argument("--measure", action="store_true", default=None,
                   help="with --experts-offload: time this machine's DRAM read, the CPU's routed experts at the "
                        "model's widths and (with CUDA) the pinned host-to-device copy, and plan with them")
    p.add_argument("--host-bandwidth", type=bandwidth,
                   help="with --experts-offload: the DRAM read bytes/s of the host the plan is for, e.g. 300GB/s: the "
                        "CPU's experts run at the kernel's fraction of it (measured with --measure, else the fraction "
                        "docs/benchmarks.md records)")
    p.add_argument("--piecewise-layer-ms", type=milliseconds,
                   help="with --experts-offload: milliseconds a MoE layer adds to a decode step beyond the GPU's own "
                        "time where the routes are read by the host (experts copied: the decode loop captures the "
                        "step between the routes' reads; default 1.5, measured on "
                        "an H100's host: bench_offload.py's loop and loop_held sections give yours)")
    p.add_argument("--host-route-ms", type=milliseconds,
                   help="with --experts-offload: milliseconds a MoE layer computing experts on the CPU with its routes "
                        "read by the host (a prefill chunk) spends on the route beyond the kernel (default 1.1, measured on an H100's host: bench_offload.py's split "
                        "section gives yours)")
    p.add_argument("--stream-layer-ms", type=milliseconds,
                   help="with --experts-offload: milliseconds a MoE layer adds to a decode step whose routes are "
                        "computed on the CPU in the stream's order (experts_compute host, or auto where the CPU is "
                        "faster; no read of the routes, the step captured whole), beyond the kernel (default 0.104, "
                        "measured on an H100's host: bench_offload.py's loop_gpu and stream_held sections give yours)")
    p.add_argument("--disk-bandwidth", type=bandwidth,
                   help="with --experts-offload disk: disk-to-host bytes/s, e.g. 14GB/s (default: 7 GB/s, an assumption "
                        "for one PCIe 4.0 NVMe SSD's sequential read, not a measurement: measure yours)")
    p.add_argument("--context", type=context_tokens,
                   help="with --plan: tokens per sequence, e.g. 131072, 128K or 1M (K = 1024; default: the model's "
                        "max_position_embeddings)")
    p.set_defaults(fn=cmd_memory)

    p = sub.add_parser("demo", help="the main job on CPU in seconds: a tiny release-layout checkpoint -> kimik3 "
                                    "convert -> reload with trust_remote_code -> generate -> cache bytes, live vs "
                                    "analytic",
                       description="Writes a tiny random checkpoint in the release's layout (MXFP4 experts) to a "
                                   "temporary folder, converts it, reloads it with AutoModelForCausalLM("
                                   "trust_remote_code=True), generates greedily and compares the cache's live bytes "
                                   "with the analytic count. Nothing is left on disk. Exit code 1 on a mismatch.")
    p.add_argument("--new-tokens", type=positive_int, default=12, help="tokens to generate (default 12)")
    p.set_defaults(fn=cmd_demo)

    p = sub.add_parser("chat", help="a chat with a model folder: chat template -> generate (stops at <|end_of_msg|>) "
                                    "-> streamed text, history kept across turns",
                       description="Chat with a model folder: each user turn is rendered with the conversation so far "
                                   "(earlier replies echoed back with their reasoning) by the folder's tokenizer and "
                                   "chat template, generated until <|end_of_msg|> and streamed. Without --prompt or "
                                   "--prompt-file the user turns are read from stdin, one a line, until end of input "
                                   "or /exit (interactive on a terminal; `printf 'hi\\nagain\\n' | kimik3 chat DIR` "
                                   "works too). Long prompts are prefilled through the cache in chunks.")
    p.add_argument("directory", help="a model folder with a tokenizer (converted release, or kimik3 tiny)")
    given = p.add_mutually_exclusive_group()
    given.add_argument("--prompt", help="one user message: a single turn (default: read turns from stdin)")
    given.add_argument("--prompt-file", metavar="FILE", help="one user message read from a UTF-8 text file")
    p.add_argument("--system", help="a system prompt, the conversation's first message")
    p.add_argument("--tools", metavar="FILE",
                   help='a JSON file of tool declarations, e.g. [{"type": "function", "function": {"name": ..., '
                        '"parameters": {...}}}] (calls the model makes are printed, not run)')
    p.add_argument("--image", metavar="PATH",
                   help="an image (local path or file:// URL) attached to the first turn; needs a model with a "
                        "vision tower")
    p.add_argument("--max-new-tokens", type=positive_int, default=64, help="generation limit a turn (default 64)")
    # a metavar, so that argparse lists the choices only for --help (building the parser would import them)
    p.add_argument("--reasoning-effort", choices=TemplateReasoningEfforts(), default="max", metavar="EFFORT",
                   help="the chat template's reasoning effort: %(choices)s (default max)")
    p.add_argument("--prefill-chunk-size", type=positive_int, metavar="TOKENS",
                   help="prompt tokens a prefill forward: bounds the prefill's memory (default: "
                        "kimik3.chat.PREFILL_CHUNK_SIZE, 2048)")
    p.set_defaults(fn=cmd_chat)

    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server for a model folder (chat completions with "
                                     "streaming, completions, models, health), requests batched step by step",
                       description="Serve a model folder over HTTP with OpenAI's API: /v1/chat/completions (streaming "
                                   "or not; reasoning and tool calls in their fields), /v1/completions, /v1/models, "
                                   "/health. Needs the serve extra (pip install 'kimik3[serve]').")
    from kimik3.arguments import add_serve_arguments

    add_serve_arguments(p)
    p.set_defaults(fn=cmd_serve)

    for name in PASSTHROUGH_HELP:
        p = sub.add_parser(name, help=f"{PASSTHROUGH_HELP[name]} (options: `kimik3 {name} --help`)", add_help=False)
        p.set_defaults(fn=None, passthrough=name)

    try:  # argparse exits (code 2, `kimik3 <cmd>: error: ...`) on a usage error; callers want the code
        args, rest = parser.parse_known_args(argv)
        if getattr(args, "passthrough", None):
            from kimik3.convert import cli as convert_cli

            return getattr(convert_cli, f"run_{args.passthrough}")(rest)
        if rest:  # the subcommand's usage and name (`kimik3 chat: error: ...`), not the top-level parser's
            sub.choices[args.command].error(f"unrecognized arguments: {' '.join(rest)}")
    except SystemExit as exc:
        return int(exc.code or 0)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
