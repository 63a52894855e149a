"""MXFP4 for the converter: the layout of packed experts and row-blocked (de)quantisation.

The format itself (E2M1 codes, two per byte with the even element in the low nibble, one E8M0 scale per
`MXFP4_GROUP_SIZE` weights along the input dim) is defined once, by the runtime's ops (`kimik3.modeling.ops_kimi_k3`);
this module only adds what streaming a checkpoint needs: shapes, byte packing, and working in row blocks so that
memory stays bounded whatever the expert size.
"""

import torch

from kimik3.modeling.release_layout_kimi_k3 import mxfp4_overflow_message
from kimik3.modeling.experts_format_kimi_k3 import mxfp4_overflow
from kimik3.modeling.ops_kimi_k3 import MXFP4_GROUP_SIZE, dequantize_mxfp4, quantize_mxfp4

from .errors import ConversionError

# Rows dequantised per call: dequantize_mxfp4 holds ~20 bytes of temporaries per weight (int64 codes, f32 values
# and factors), so 1M weights keep its working set near 20 MB whatever the expert size.
BLOCK_WEIGHTS = 1 << 20


def packed_shapes(logical: tuple[int, int]) -> tuple[tuple[int, int], tuple[int, int]]:
    """(packed codes shape, scale shape) of a logical [out, in] weight."""
    out_dim, in_dim = logical
    return (out_dim, in_dim // 2), (out_dim, in_dim // MXFP4_GROUP_SIZE)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 E2M1 codes [..., K] -> bytes [..., K/2], the even element in the low nibble."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()


def _row_step(width: int) -> int:
    return max(1, BLOCK_WEIGHTS // max(1, width))


def check_finite_decode(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, where: str,
                        prefix: tuple[int, ...] = (), row_offset: int = 0) -> None:
    """Every group must decode to finite values in `dtype` (the dtype the values are written in, or computed in for
    kept-packed experts): a valid E8M0 byte can still overflow it (0xFE with code 6.0 is inf in bf16). `where` names
    the file and tensor; for rows of one expert of a fused [E, R, G] tensor, `prefix` is (expert,) and `row_offset`
    the first row, so the index named is the fused tensor's."""
    found = mxfp4_overflow(packed, scale, dtype)
    if found is not None:
        index, byte, code = found
        index = [*prefix, index[0] + row_offset, *index[1:]]
        raise ConversionError(f"{where}: {mxfp4_overflow_message(index, byte, code, dtype)}")


def dequantize_into(out: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, where: str | None = None,
                    prefix: tuple[int, ...] = (), row_offset: int = 0) -> None:
    """dequantize_mxfp4 into a preallocated [rows, K] tensor, a row block at a time, after checking that every value
    is finite in out.dtype (`where` names the source in the error)."""
    check_finite_decode(packed, scale, out.dtype, where or "MXFP4 tensor", prefix, row_offset)
    step = _row_step(out.shape[-1])
    for row in range(0, out.shape[0], step):
        out[row:row + step] = dequantize_mxfp4(packed[row:row + step], scale[row:row + step], out.dtype)


def quantize_rows(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """quantize_mxfp4 in row blocks (it holds ~32 bytes of temporaries per weight), measuring the round-trip error
    of each block as it goes. Returns (packed, scale, error statistics)."""
    step = _row_step(dense.shape[-1])
    packed, scales = [], []
    stats = {"exact_experts": 1, "weights": dense.numel(), "sum_sq_err": 0.0, "sum_sq_ref": 0.0, "max_abs_err": 0.0}
    for row in range(0, dense.shape[0], step):
        ref = dense[row:row + step].float()
        block_packed, block_scale = quantize_mxfp4(ref)
        err = dequantize_mxfp4(block_packed, block_scale, torch.float32) - ref
        stats["exact_experts"] &= int(not torch.any(err != 0))
        stats["sum_sq_err"] += float((err * err).sum())
        stats["sum_sq_ref"] += float((ref * ref).sum())
        stats["max_abs_err"] = max(stats["max_abs_err"], float(err.abs().max()) if err.numel() else 0.0)
        packed.append(block_packed)
        scales.append(block_scale)
    return torch.cat(packed), torch.cat(scales), stats


__all__ = ["MXFP4_GROUP_SIZE", "dequantize_mxfp4", "quantize_mxfp4", "packed_shapes", "pack_codes",
           "check_finite_decode", "dequantize_into", "quantize_rows"]
