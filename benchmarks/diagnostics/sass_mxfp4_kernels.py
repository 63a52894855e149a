"""The packed MXFP4 kernels' machine code, counted without a GPU (a diagnostic, not a test): each kernel compiled by
Triton for sm_90 (Hopper) with the specialisations a launch at the benchmark model's shapes gets (every pointer and
N, K/8, experts divisible by 16), disassembled with the cuobjdump Triton ships, and its main loop (the longest
backward branch) counted: instructions a loop step, 32-bit words of packed weights a thread handles a step, and so
instructions per word, with the opcode mix, the registers a thread and the step's global loads: plain loads the step
waits for (LDG) and asynchronous copies into shared memory issued steps ahead by Triton's pipeline (LDGSTS). Nsight
Compute measured the GEMV at 52.6 instructions a word on an H100 (docs/benchmarks.md, Packed MXFP4 GEMV); this count
gives 52.6 for its tuned tile, so candidates can be compared before a GPU is at hand.

Needs Triton (`pip download --no-deps triton==3.6.0` then `pip install --no-deps --target DIR` and DIR on
PYTHONPATH is enough; no CUDA driver is used):

    PYTHONPATH=/tmp/tritonlib python3 benchmarks/diagnostics/sass_mxfp4_kernels.py          # the decode kernels
    PYTHONPATH=/tmp/tritonlib python3 benchmarks/diagnostics/sass_mxfp4_kernels.py --gemm   # the prefill GEMMs
"""

import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kimik3.kernels import mxfp4

CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
PTR_AND_SIZES = ["x_ptr", "xe_ptr", "xo_ptr", "p_ptr", "s_ptr", "o_ptr", "ends_ptr", "M", "N", "KW", "KH", "E"]


def compile_sm90(kernel, signature, constexprs, num_warps, num_stages):
    """kernel (a JITFunction, or an autotuner around one) compiled for sm_90; pointers and sizes divisible by 16."""
    while not isinstance(kernel, triton.runtime.jit.JITFunction):
        kernel = kernel.fn
    sig = {**signature, **{name: "constexpr" for name in constexprs}}
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in signature
             if name in PTR_AND_SIZES}
    source = ASTSource(kernel, sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def _cuobjdump(compiled, flag):
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
    try:
        return subprocess.run([str(CUOBJDUMP), flag, f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)


def main_loop(sass):
    """(instructions, opcode counts) of the longest backward branch's body."""
    best = None
    for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?BRA\s+0x([0-9a-f]+)", sass):
        at, to = int(m.group(1), 16), int(m.group(2), 16)
        if to < at and (best is None or at - to > best[0] - best[1]):
            best = (at, to)
    ops = collections.Counter()
    for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9]+)", sass):
        if best and best[1] <= int(m.group(1), 16) <= best[0]:
            ops[m.group(2)] += 1
    return sum(ops.values()), ops


def report(name, kernel, signature, constexprs, words_per_step, num_warps, num_stages):
    compiled = compile_sm90(kernel, signature, constexprs, num_warps, num_stages)
    count, ops = main_loop(_cuobjdump(compiled, "-sass"))
    regs = re.search(r"REG:(\d+)", _cuobjdump(compiled, "-res-usage"))
    per_thread = words_per_step / (32 * num_warps)
    print(f"{name}: {count} instructions a step, {per_thread:g} words a thread, {count / per_thread:.1f} a word, "
          f"{regs.group(1) if regs else '?'} registers; global loads a step: {ops['LDG']} waited for in the step "
          f"(LDG), {ops['LDGSTS']} asynchronous copies (LDGSTS); {dict(ops.most_common(10))}", flush=True)


def gemm_counts():
    """The product's packed prefill GEMMs, the byte-decoding one and the word-decoding one (the default, with the
    bf16 pairs and with the f32 decode), for their autotuner's tiles."""
    ints = {"N": "i32", "E": "i32", "M": "i32"}
    halves = {"xe_ptr": "*bf16", "xo_ptr": "*bf16", "p_ptr": "*u8", "s_ptr": "*u8", "o_ptr": "*bf16", "ends_ptr": "*i32",
              "KH": "i32", **ints}
    for cfg in mxfp4._mxfp4_grouped_gemm_kernel.configs:
        kw = dict(cfg.kwargs)
        report(f"GEMM (bytes) {kw} {cfg.num_warps} warps {cfg.num_stages} stages", mxfp4._mxfp4_grouped_gemm_kernel,
               halves, {"E_PAD": 1024, "W_IS_A": False, "SCALE_BCAST": True, "PRECISION": "tf32", **kw},
               kw["BLOCK_N"] * kw["BLOCK_KH"] // 4, cfg.num_warps, cfg.num_stages)
    words = {"x_ptr": "*bf16", "p_ptr": "*i32", "s_ptr": "*u8", "o_ptr": "*bf16", "ends_ptr": "*i32", "KW": "i32", **ints}
    for cfg in mxfp4._mxfp4_word_gemm_kernel.configs:
        kw = dict(cfg.kwargs)
        for pairs in (True, False):
            report(f"GEMM (words){', bf16 pairs' if pairs else ', f32 decode'} {kw} {cfg.num_warps} warps "
                   f"{cfg.num_stages} stages", mxfp4._mxfp4_word_gemm_kernel, words,
                   {"E_PAD": 1024, "PTX_DECODE": True, "PRECISION": "tf32", "BF16_PAIRS": pairs, **kw},
                   kw["BLOCK_N"] * kw["BLOCK_KW"], cfg.num_warps, cfg.num_stages)


def main():
    if "--gemm" in sys.argv[1:]:
        return gemm_counts()
    x16 = {"x_ptr": "*bf16", "p_ptr": "*i32", "s_ptr": "*u8", "o_ptr": "*bf16", "ends_ptr": "*i32", "N": "i32",
           "KW": "i32", "E": "i32"}
    for bn, bkw, w in ((16, 64, 2), (16, 64, 4), (32, 32, 4)):
        report(f"GEMV BLOCK_N {bn} BLOCK_KW {bkw} {w} warps", mxfp4._mxfp4_gemv_kernel, {**x16, "ROW_CLASS": "i32"},
               {"E_PAD": 64, "PTX_DECODE": True, "BLOCK_N": bn, "BLOCK_KW": bkw}, bn * bkw, w, 2)
    for cfg in mxfp4._mxfp4_word_tiles_kernel.configs:
        for name, tf32, pairs in (("bf16 pairs", False, True), ("bf16 via f32", False, False), ("tf32", True, False)):
            kw = dict(cfg.kwargs)
            report(f"word tiles {name} {kw} {cfg.num_warps} warps {cfg.num_stages} stages",
                   mxfp4._mxfp4_word_tiles_kernel, x16,
                   {"E_PAD": 64, "BLOCK_M": 16, "TF32": tf32, "PTX_DECODE": True, "BF16_PAIRS": pairs, **kw},
                   kw["BLOCK_N"] * kw["BLOCK_KW"], cfg.num_warps, cfg.num_stages)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from sweep_mxfp4_word_tiles import CONFIGS as WORD_TILE_SWEEP

    for bn, bkw, w, st, w_is_a, reg in WORD_TILE_SWEEP[len(mxfp4._mxfp4_word_tiles_kernel.configs):]:
        if reg is not None:  # register caps: counted by the sweep's docstring, not here
            continue
        report(f"word tiles bf16 pairs (sweep) BLOCK_N {bn} BLOCK_KW {bkw} W_IS_A {w_is_a} {w} warps {st} stages",
               mxfp4._mxfp4_word_tiles_kernel, x16,
               {"E_PAD": 64, "BLOCK_M": 16, "TF32": False, "PTX_DECODE": True, "BF16_PAIRS": True, "BLOCK_N": bn,
                "BLOCK_KW": bkw, "W_IS_A": w_is_a}, bn * bkw, w, st)
    bytes16 = {**{k: v for k, v in x16.items() if k != "KW"}, "p_ptr": "*u8", "KH": "i32"}
    for bn, bkh, w, st in ((64, 64, 4, 3), (64, 128, 4, 3)):
        report(f"tl.dot_scaled tiles BLOCK_N {bn} BLOCK_KH {bkh} {w} warps", mxfp4._mxfp4_scaled_dot_kernel,
               {k: bytes16[k] for k in ("x_ptr", "p_ptr", "s_ptr", "o_ptr", "ends_ptr", "N", "KH", "E")},
               {"E_PAD": 64, "BLOCK_M": 16, "BLOCK_N": bn, "BLOCK_KH": bkh}, bn * bkh // 4, w, st)


if __name__ == "__main__":
    main()
