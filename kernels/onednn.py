"""Linear layers on the CPU in bfloat16 through oneDNN, with each weight packed once.

torch's `F.linear` in bfloat16 on the CPU runs oneDNN's matmul, which reorders the weight into its
blocked layout on every call. Packed once at load (`pack`), the same matmul (`linear`) gives the
same bits without the reorder (the chat bench's bfloat16 row in docs/benchmarks.md runs on it).
float32 stays on `F.linear` (MKL):
oneDNN's float32 matmul rounds differently, and pagedctl's float32 tokens must equal
transformers'.
"""

from __future__ import annotations

import torch
from torch import Tensor

PACK_ROWS = 32  # the batch the packed layout is chosen for (a decode batch); any row count runs


def packs(weight: Tensor) -> bool:
    """Whether `weight` (`[out, in]`) is packed for oneDNN: a bfloat16 CPU tensor, where torch
    was built with oneDNN and the CPU has its bfloat16 instructions (AVX-512 or AVX-NE-CONVERT;
    an AVX2-only CPU keeps `F.linear`)."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def pack(weight: Tensor) -> Tensor:
    """An opaque oneDNN copy of `weight` for `linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS)


def linear(x: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
    """`x @ weight.T (+ bias)` of `[T, in]` rows through a packed weight: `F.linear`'s bits."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
