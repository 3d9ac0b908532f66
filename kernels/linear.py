"""Linear layers with quantized weights: y = x W^T for FP8 (e4m3 + E8M0 block scales), FP4 (packed e2m1
+ E8M0 per 32 inputs) or dense weights, with the official FP8 activation quantization of x in front.

Reference numerics: the activation is rounded to power-of-two-scaled e4m3 per `act_block` elements
(none in `plain` numerics), the product is accumulated in float64 and rounded once to `out_dtype`. With
quantized operands the float64 sum is exact in practice, so the result does not depend on how many rows
are computed together (batch invariance, which lossless speculative decoding needs).
"""

from dataclasses import dataclass, field

import torch

from .formats import dequant_fp4, dequant_fp8, q8_pow2


@dataclass
class PackedWeight:
    """A linear weight [out, in] as stored in the checkpoint (memory-mapped; the kernels read it packed).

    format: "fp8" (data e4m3 [out, in], scale E8M0 [ceil(out/bo), ceil(in/bi)]),
            "fp4" (data int8 [out, in/2], scale E8M0 [out, in/32]),
            "dense" (data bf16/f32 [out, in])."""

    name: str
    shape: tuple[int, int]
    format: str
    data: torch.Tensor
    scale: torch.Tensor | None = None
    block: tuple[int, int] | None = None
    _dense64: torch.Tensor | None = field(default=None, repr=False)

    def dequantize(self) -> torch.Tensor:
        """Exact float32 values [out, in]."""
        if self.format == "fp8":
            return dequant_fp8(self.data, self.scale, self.block)
        if self.format == "fp4":
            return dequant_fp4(self.data, self.scale, self.block[1])
        return self.data.float()

    def dense64(self) -> torch.Tensor:
        """float64 [in, out] copy for the reference GEMM, made once."""
        if self._dense64 is None:
            self._dense64 = self.dequantize().double().t().contiguous()
        return self._dense64

    @property
    def nbytes(self) -> int:
        n = self.data.numel() * self.data.element_size()
        return n + (0 if self.scale is None else self.scale.numel() * self.scale.element_size())


def reference(x: torch.Tensor, weight: PackedWeight, act_block: int | None, out_dtype: torch.dtype) -> torch.Tensor:
    """x [..., in] -> [..., out] in out_dtype.

    Bytes moved: weight.nbytes (read once) + x.numel()*x.element_size() + out.numel()*out.element_size()."""
    a = q8_pow2(x, act_block) if act_block else x.float()
    return torch.matmul(a.double(), weight.dense64()).to(out_dtype)


def dense_reference(x: torch.Tensor, weight64: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """A plain (unquantized) product with a float64 [in, out] weight: one rounding to out_dtype."""
    return torch.matmul(x.double(), weight64).to(out_dtype)
