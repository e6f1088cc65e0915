"""The numeric primitives the reference forward is written in, in two flavours.

`FastOps` uses PyTorch's native kernels: batched GEMMs, `torch.sum`, `torch.exp`. Their reduction
order (GEMM blocking, GEMV vs GEMM dispatch, vectorised partial sums over padded lengths) depends on
how many rows are in the call, so a request's numbers can change with the batch around it.

`InvariantOps` (batch-invariant mode) makes every row's arithmetic a function of that row alone:

* `linear`: one matrix-vector call per row ([N, K] x [K]); no call ever sees another row,
  so no batch-size-dependent split or kernel choice can occur.
* `sum` (and everything built on it: mean, softmax, RMS norms, attention, pooling): a fixed binary
  tree of element-wise adds over the reduced dim, zero-padded to a power of two. Element-wise adds
  are exact IEEE operations on any device, and trailing zero padding leaves the tree's result
  unchanged, so the sum of a row is the same whatever length the batch padded it to.
* transcendental element-wise functions (`exp`, `sigmoid`, `silu`, `softplus`, `rsqrt`): on CPU
  PyTorch evaluates the body of a tensor with SIMD code and the tail with scalar libm code, which can
  differ in the last bit. Here the input is flattened, padded to a multiple of 64 and evaluated in
  chunks below the parallel grain size, so every element takes the SIMD path; on CUDA there is one
  code path anyway.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_PAD = 64
_CHUNK = 16384  # elements per element-wise call: below ATen's parallel grain size (32768)


class FastOps:
    """Native PyTorch kernels; fast, batch-dependent rounding."""

    invariant = False

    def kernel_for(self, op: str):
        """The generated kernel serving model op ``op`` (model_ops.py): none in a PyTorch flavour."""
        return None

    def linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """FP32 `x @ w.T` for x [..., K], w [N, K] (a BF16 weight, as ``wo_a`` may be kept, in FP32)."""
        return F.linear(x.float(), w.float())

    def sum(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return x.sum(dim)

    def exp(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(x)

    def sigmoid(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(x)

    def silu(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(x)

    def softplus(self, x: torch.Tensor) -> torch.Tensor:
        return F.softplus(x)

    def rsqrt(self, x: torch.Tensor) -> torch.Tensor:
        return torch.rsqrt(x)

    # ---- composites (shared by both flavours) ---------------------------------------------------
    def mean(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return self.sum(x, dim) / x.shape[dim]

    def softmax(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Softmax in FP32; -inf entries get weight 0 (a row of only -inf gives NaN, never used)."""
        x = x.float()
        e = self.exp(x - x.amax(dim, keepdim=True))
        return e / self.sum(e, dim).unsqueeze(dim)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        """`w * x / sqrt(mean(x^2) + eps)` over the last dim, in FP32."""
        x = x.float()
        y = x * self.rsqrt(self.mean(x * x, -1) + eps).unsqueeze(-1)
        return y if weight is None else y * weight


class InvariantOps(FastOps):
    """Row-independent arithmetic (see the module docstring)."""

    invariant = True

    def linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        x, w = x.float(), w.float()
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] == 0:
            return F.linear(x, w)
        out = torch.stack([torch.mv(w, row) for row in rows])
        return out.reshape(*x.shape[:-1], w.shape[0])

    def sum(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        dim = dim % x.ndim
        n = x.shape[dim]
        if n == 0:
            return x.sum(dim)
        width = 1 << (n - 1).bit_length()
        if width != n:
            pad_shape = list(x.shape)
            pad_shape[dim] = width - n
            x = torch.cat([x, x.new_zeros(pad_shape)], dim)
        while width > 1:
            width //= 2
            x = x.narrow(dim, 0, width) + x.narrow(dim, width, width)
        return x.squeeze(dim)

    def _pointwise(self, fn, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1)
        n = flat.numel()
        if n == 0:
            return fn(x)
        padded = torch.zeros(-(-n // _PAD) * _PAD, dtype=x.dtype, device=x.device)
        padded[:n] = flat
        if x.device.type == "cpu":
            out = torch.cat([fn(padded[i : i + _CHUNK].clone()) for i in range(0, padded.numel(), _CHUNK)])
        else:
            out = fn(padded)
        return out[:n].reshape(x.shape)

    def exp(self, x: torch.Tensor) -> torch.Tensor:
        return self._pointwise(torch.exp, x)

    def sigmoid(self, x: torch.Tensor) -> torch.Tensor:
        return self._pointwise(torch.sigmoid, x)

    def silu(self, x: torch.Tensor) -> torch.Tensor:
        return self._pointwise(F.silu, x)

    def softplus(self, x: torch.Tensor) -> torch.Tensor:
        return self._pointwise(F.softplus, x)

    def rsqrt(self, x: torch.Tensor) -> torch.Tensor:
        return self._pointwise(torch.rsqrt, x)
