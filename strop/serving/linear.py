"""The decoder's linear layers: a layer's weights (q/k/v or gate/up fused into one), packed for the CPU's
fastest kernel (oneMKL in fp32, oneDNN in bf16) where this torch build has it, else ``F.linear``."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class PackedLinear:
    """One or more linear layers fused along their outputs (q, k, v; gate, up), computed from a
    weight copy that is refreshed whenever the model's parameters change. On a CPU it also keeps
    the weight pre-packed for the running batch size where a packed kernel exists: MKL's sgemm for
    fp32 weights (it otherwise repacks the weight on every call, about a third of a decode step at
    batch 64), oneDNN's for bf16 (the pair Inductor uses on CPU; 1.2-1.6x faster per call at batch
    64). Packing changes no result (same kernel, same reduction order; tested bitwise)."""

    def __init__(self, modules):
        self.modules = modules
        self.weight = self.bias = self.packed = None
        self.packed_rows, self.packs = 0, {}

    def refresh(self) -> None:
        ws = [m.weight.detach() for m in self.modules]
        self.weight = ws[0] if len(ws) == 1 else torch.cat(ws)
        bs = [m.bias for m in self.modules]
        self.bias = (
            None
            if all(b is None for b in bs)
            else torch.cat(
                [
                    b.detach()
                    if b is not None
                    else torch.zeros(m.weight.shape[0], dtype=m.weight.dtype, device=m.weight.device)
                    for b, m in zip(bs, self.modules)
                ]
            )
        )
        self.packed, self.packed_rows, self.packs = None, 0, {}

    def pack(self, rows: int, keep: bool = False) -> None:
        """Use the weight packed for ``rows`` rows; ``keep``: keep the packing it replaces too, for the next
        switch back (speculation's rounds alternate between a plain step's rows and a drafting one's)."""
        if self.packed_rows != rows:
            packed = self.packs.pop(rows, None)
            if packed is None and self.weight.dtype == torch.float32:
                packed = torch.ops.mkl._mkl_reorder_linear_weight(self.weight, rows)
            elif packed is None:  # bf16: oneDNN's layout; the packed weight serves any row count (``rows`` is a hint)
                packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, rows)
            self.packs = {self.packed_rows: self.packed} if keep and self.packed is not None else {}
            self.packed, self.packed_rows = packed, rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and x.dim() == 2:
            if self.weight.dtype != torch.float32:
                return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
            if x.shape[0] == self.packed_rows:
                return torch.ops.mkl._mkl_linear(x, self.packed, self.weight, self.bias, self.packed_rows)
        return F.linear(x, self.weight, self.bias)


def return_freed_memory() -> None:
    """Packed buffers are tens of MB each, below glibc's mmap threshold once it has adapted, so
    freeing them leaves the memory in the heap; ``malloc_trim`` gives it back to the system
    (measured: 0.34 GB retained per rollout otherwise, which the trainer's peak then carries)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def can_pack(weight: torch.Tensor) -> bool:
    if weight.device.type != "cpu":
        return False
    if weight.dtype == torch.float32:
        return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")
    return (
        weight.dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )
