"""Compile options that rumus_fx offers, and sets only on programs of its own.

``CPU_COMPILER_OPTIONS`` is a value to pass to ``jax.jit(f, compiler_options=...)``
or ``jax.jit(f).lower(...).compile(compiler_options=...)`` for a program compiled
for XLA:CPU. It restricts XLA:CPU's YNNPACK fusions (on by default in jax 0.10) to
single dots and reductions, so convolutions run through XLA's own (Eigen) kernels,
which were 2-3x faster than YNNPACK's for the few-channel convolutions of small
CNNs before conv2d ran those as dots; the benchmark CNN's step is now slower with
it (14.5 against 11.3 ms), and dense models (MLP, transformer) compile to the same
program either way.
The library sets no process-wide XLA flag: this is opt-in, per compiled function.
The one place rumus_fx passes it itself is the programs that conv2d's forward
and backward compile for their own eager calls on a CPU device (Note [Eager
compiler options] in rumus_fx/eager.py); a jitted step is compiled as the user
asks.
Measurements with and without it are in ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import types

CPU_COMPILER_OPTIONS: types.MappingProxyType[str, str] = types.MappingProxyType(
    {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT,LIBRARY_FUSION_TYPE_REDUCE"}
)
