"""conv2d's plan: which formulation (Note [Convolution formulations] in
``_conv_formulations.py``) computes each of its products.

Note [Convolution plan]
~~~~~~~~~~~~~~~~~~~~~~~
XLA:CPU's convolution (Eigen, or YNNPACK fusions by default in jax 0.10) is
slow for few input channels, where a dot with a short contraction is fast.
``conv_plan`` picks per product from (C_in, K, stride, the im2col's size); its
thresholds come from the timed grid of ``benchmarks/conv_grid.py``, from the
same products timed over spatial sizes 14-56 and, for the few-channel layers,
from the CNN step of ``benchmarks/models.py``: a product timed alone misses
what its layout costs the fusions XLA builds around it. The timings behind
each threshold: ``benchmarks/RESULTS.md``, "Thresholds in the code". Inputs on
a multi-device mesh (Explicit or Auto axes) always take "conv" (the caller
checks): XLA's partitioner shards the dot formulations' products by other
dimensions than the convolution's, and each gradient must keep its
parameter's sharding (SPEC section 10).
"""

from __future__ import annotations

DOT_MAX_CKK = 27  # largest contraction C_in*K*K for which y and dx take "dot"
BDOT_MAX_C_1X1 = 32  # dw of a 1x1 kernel: "bdot" up to this many input channels, "dot" beyond
BDOT_MAX_C_3X3 = 16  # dw of a 3x3 kernel: "bdot" up to this many input channels
COLS_MAX = 4 * 2**20  # elements of the im2col above which dw of a larger kernel takes "conv"
GEMM_MAX_C = 64  # "gemm" for 4..GEMM_MAX_C input channels
GEMM_COLS_MAX = 2 * 2**20  # and an im2col of at most this many elements


def conv_plan(c_in: int, k: int, s: int, cpu_eager: bool = False, cols: int = 0) -> tuple[str, str, str]:
    """The formulations of the forward product, dx and dw (Note [Convolution plan]):

    * a 1x1 kernel: "dot" for y and dx at every channel count; dw "bdot" up to
      ``BDOT_MAX_C_1X1`` input channels, "dot" beyond;
    * a larger kernel: "dot" for y and dx while the contraction ``C_in*K*K``
      is at most ``DOT_MAX_CKK``, "conv" beyond; dw "bdot" for a 3x3 kernel up
      to ``BDOT_MAX_C_3X3`` input channels, "conv" otherwise, and "conv" too
      where the im2col has more than ``COLS_MAX`` elements (``cols``, see
      ``cols_size``) at stride 1 and more than three input channels;
    * "gemm" for y and dw (dx "conv") of a 3x3 kernel at stride 1 with 4 to
      ``GEMM_MAX_C`` input channels and an im2col of at most
      ``GEMM_COLS_MAX`` elements, under a trace only: eagerly the forward and
      dw are separate programs and share no im2col;
    * ``cpu_eager``: the plan of a product compiled on its own for one CPU
      device with ``CPU_COMPILER_OPTIONS`` (an eager call, Note [Eager
      compiler options]), where XLA's own convolution is the fastest dw of a
      larger kernel: dw takes "conv"; the rest is the same."""
    small = k == 1 or c_in * k * k <= DOT_MAX_CKK
    big = s == 1 and c_in > 3 and cols > COLS_MAX
    if not cpu_eager and k == 3 and s == 1 and 3 < c_in <= GEMM_MAX_C and 0 < cols <= GEMM_COLS_MAX:
        return "gemm", "conv", "gemm"
    if k == 1:
        dw = "bdot" if c_in <= BDOT_MAX_C_1X1 else "dot"
    elif cpu_eager:
        dw = "conv"
    else:
        dw = "bdot" if k == 3 and c_in <= BDOT_MAX_C_3X3 and not big else "conv"
    return ("dot" if small else "conv"), ("dot" if small else "conv"), dw


def cols_size(b: int, c: int, h: int, w: int, k: int, s: int, p: int) -> int:
    """Elements of the im2col of ``x:[b, c, h, w]`` for a ``k``x``k`` kernel."""
    return b * c * k * k * ((h + 2 * p - k) // s + 1) * ((w + 2 * p - k) // s + 1)
