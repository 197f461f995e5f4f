"""The decoder's linear layers: a layer's weights (q/k/v or gate/up fused into one), packed for the kernel the
decoder runs on this CPU (:mod:`strop.serving.cpu_kernels`: oneMKL or oneDNN), else ``F.linear``."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from strop.serving.cpu_kernels import choose, computes_in


ONEDNN_HINT = 64  # the row count oneDNN's packed layout is chosen for
WIDEN_ROWS = 3  # bf16 layers computed in float32 from this many rows up (below it, F.linear's bf16 product is faster)


class PackedLinear:
    """One or more linear layers fused along their outputs (q, k, v; gate, up), computed from a
    weight copy that is refreshed whenever the model's parameters change. On a CPU it also keeps
    the weight pre-packed for the running batch size in the layout of the kernel the decoder runs
    (:mod:`strop.serving.cpu_kernels`): MKL's sgemm (fp32; it otherwise repacks the weight on every
    call, about a third of a decode step at batch 64) or oneDNN's (fp32 and bf16; the pair Inductor
    uses on CPU; one packing serves every row count). Packing changes no result against the same kernel unpacked
    (tested bitwise). Where oneDNN computes in a wider dtype than the weights' (bf16 on a CPU without bf16
    instructions, :func:`strop.serving.cpu_kernels.computes_in`) the packed weight and bias are that dtype's copies,
    and each call of 3 rows or more widens its input and rounds its output back (on an AMD EPYC with AVX2, a bf16
    decode step's linear layers took 78.6 ms this way at 32 rows against F.linear's 433.7; at 1 row 25.4 against
    15.4, so 1-2 rows run F.linear)."""

    def __init__(self, modules, kernel: str = "mkl"):
        self.modules = modules
        self.weight = self.bias = self.packed = None
        self.packed_rows, self.packs = 0, {}
        self.kernel = kernel  # what the next pack() packs for: "mkl" or "onednn" (the decoder sets it)
        self.packed_kernel = None  # what ``packed`` is packed for
        self.packed_bias = None  # the bias in the packed weight's dtype

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
        self.packed, self.packed_rows, self.packed_kernel, self.packs, self.packed_bias = None, 0, None, {}, None

    def pack(self, rows: int, keep: bool = False) -> None:
        """Use the weight packed for ``rows`` rows and ``self.kernel``; ``keep``: keep the packing it replaces too,
        for the next switch back (speculation's rounds alternate between a plain step's rows and a drafting
        one's, and between the default kernel and the batch-invariant one)."""
        if self.kernel != "mkl":  # oneDNN: one layout serves every row count (the hint changes no bit)
            rows = 0
        want = (self.kernel, rows)
        if (self.packed_kernel, self.packed_rows) != want:
            packed = self.packs.pop(want, None)
            if packed is None and self.kernel == "mkl":
                packed = torch.ops.mkl._mkl_reorder_linear_weight(self.weight, rows)
            elif packed is None:  # (packed for 64 rows: as fast as a layout for the count at 8 to 2560, measured)
                wide = computes_in(self.kernel, self.weight.dtype)
                packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.to(wide), ONEDNN_HINT)
            old = (self.packed_kernel, self.packed_rows)
            self.packs = {old: self.packed} if keep and self.packed is not None else {}
            self.packed, self.packed_rows, self.packed_kernel = packed, rows, self.kernel
            self.packed_bias = None if self.bias is None else self.bias.to(packed.dtype)

    def _onednn(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.packed.dtype:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.packed_bias, "none", [], "")
        if x.numel() < WIDEN_ROWS * x.shape[-1]:  # (1-2 rows: reading the float32 copy costs more, measured)
            return F.linear(x, self.weight, self.bias)
        wide = x.to(self.packed.dtype)  # (bf16 weights on a CPU without bf16 instructions: widened, class doc)
        return torch.ops.mkldnn._linear_pointwise(wide, self.packed, self.packed_bias, "none", [], "").to(x.dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and x.dim() == 2:
            if self.packed_kernel == "onednn":
                return self._onednn(x)
            if x.shape[0] == self.packed_rows:
                return torch.ops.mkl._mkl_linear(x, self.packed, self.weight, self.bias, self.packed_rows)
        return F.linear(x, self.weight, self.bias)

    def batched(self, x: torch.Tensor) -> torch.Tensor:
        """``self(x)`` for a prefill's (N, P, in) too: oneDNN's packed weight takes it whole (on an AMD EPYC 2.2x
        faster than ``F.linear``'s MKL in fp32, measured). ``self(x)`` keeps 3-D inputs on ``F.linear``, which
        the batch-invariant prefill rests on."""
        if self.packed is not None and self.packed_kernel == "onednn":
            return self._onednn(x)
        return self(x)


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
    """Whether the decoder's default kernel for ``weight`` packs it (:func:`strop.serving.cpu_kernels.choose`)."""
    return choose("auto", weight.dtype, weight.device) != "plain"
