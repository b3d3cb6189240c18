"""Normalisation: layer_norm (last axis, any rank) and batch_norm_2d (train/eval)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from ..autograd.record import Record, VersionSnapshot, exact_value
from ..errors import ShapeError
from ..kernels import batch_norm as kbn
from ..kernels import layer_norm as kln
from ..kernels.precision import upcast
from ..tensor import Tensor
from ._core import (
    array_of,
    eager_jit,
    is_real_scalar,
    is_tracked,
    new_output,
    reads,
    record,
    require_float,
    shape_of,
    tape_for,
)
from ._declare import BadInput, Sample, integers, normal, op, positive, tracked

Array = jax.Array
frozen = dataclasses.dataclass(frozen=True, eq=False)


def _optional(x: Any, op: str, what: str) -> Any:
    return None if x is None else array_of(x, op, what)


def _check_eps(op: str, eps: Any) -> float:
    if not is_real_scalar(eps) or eps < 0:
        raise ValueError(f"{op}: eps must be a non-negative python float, got {eps!r}")
    return float(eps)


@frozen
class LayerNormBackward(Record):
    """``y = (x - mean) * rstd * w + b`` over the last axis, for any rank (the
    gradient keeps the input's shape: rumus flattened it for rank >= 3).

    Saves the input, the weight (when given) and the per-row mean and 1/std.
    """

    input: Array
    input_version: VersionSnapshot | None
    weight: Array | None
    weight_version: VersionSnapshot | None
    save: tuple[Array, Array]  # (mean, rstd), each of shape input.shape[:-1]
    norm_size: int
    has_bias: bool
    bias_dtype: Any = None  # the bias gradient's dtype (the kernels return g's)
    weight_dtype: Any = None  # set when there is a weight
    derived_fields = ("save",)

    def derive(self, entry: Any, env: dict[int, Any]) -> LayerNormBackward:
        """The statistics as functions of the (substituted) input."""
        if self.input is None:
            return self
        return dataclasses.replace(self, save=_derived_stats(self.input, (-1,), *self.save))

    def backward(self, g, needs):
        if not (needs[0] or needs[1]):  # only the bias: the input was not saved
            return None, None, _bias_grad(g, tuple(range(g.ndim - 1)), self.bias_dtype)
        mean, rstd = self.save
        weight = _weight_for_dw(self.weight, needs[1], self.norm_size, self.weight_dtype)
        dx, dw, db = kln.layer_norm_bwd(self.input, weight, mean, rstd, g, has_bias=self.has_bias and needs[2])
        return (
            dx if needs[0] else None,
            dw if needs[1] else None,
            _as_bias(db, self.bias_dtype) if needs[2] else None,
        )


def _derived_stats(x: Array, axes: tuple[int, ...], mean: Array, rstd: Array) -> tuple[Array, Array]:
    """(mean, 1/std) over ``axes`` as functions of ``x``, equal in value to the
    saved ones (``exact_value``); the epsilon the forward added is recovered
    from the saved ``rstd`` (a constant, so only its rounding enters, in the
    last bits of the derivatives)."""
    xf = upcast(x)
    m = jnp.mean(xf, axis=axes, keepdims=True)
    var = jnp.mean(jnp.square(xf - m), axis=axes)
    m = m.reshape(var.shape)
    r32 = rstd.astype(var.dtype)
    eps = jax.lax.stop_gradient(1 / (r32 * r32) - var)
    return exact_value(mean, m), exact_value(rstd, jax.lax.rsqrt(var + eps))


def _weight_for_dw(weight: Any, need_w: bool, size: int, dtype: Any) -> Any:
    """The weight the backward kernels read. The weight's *data* is saved only
    when the input's gradient reads it; when only the weight's own gradient is
    needed (an untracked input), the kernels still need a weight to return
    ``dw``: ones of its shape and dtype (``dw`` does not depend on its value)."""
    if weight is None and need_w:
        return jnp.ones((size,), dtype)
    return weight


def _bias_grad(g: Array, axes: tuple[int, ...], dtype: Any) -> Array:
    """``db = sum(g)`` over ``axes`` (accumulated in float32 for low precision)."""
    return _as_bias(jnp.sum(upcast(g), axis=axes).astype(g.dtype), dtype)


def _as_bias(db: Any, dtype: Any) -> Any:
    return db if db is None or dtype is None or db.dtype == dtype else db.astype(dtype)


def ref_layer_norm(x: Any, w: Any = None, b: Any = None, eps: float = 1e-5) -> Array:
    """The jax.numpy oracle of ``layer_norm`` (op table)."""
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean((x - mean) ** 2, axis=-1, keepdims=True)
    y = (x - mean) / jnp.sqrt(var + eps)
    lead = (1,) * (x.ndim - 1)
    if w is not None:
        y = y * w.reshape(lead + w.shape)
    if b is not None:
        y = y + b.reshape(lead + b.shape)
    return y


@op(
    records=(LayerNormBackward,),
    ref=ref_layer_norm,
    samples=lambda r: [
        Sample((normal(r, 3, 5), positive(r, 5), normal(r, 5)), diff=(0, 1, 2)),
        Sample((normal(r, 2, 3, 7), positive(r, 7), normal(r, 7)), diff=(0, 1, 2)),
        Sample((normal(r, 2, 2, 3, 6),), diff=(0,)),
        Sample((normal(r, 4, 6), positive(r, 6), None, 1e-3), diff=(0, 1)),
    ],
    errors=lambda: [
        BadInput("weight size", (tracked(3, 5), tracked(4)), ShapeError, ("(5,)", "(4,)")),
        BadInput("rank-2 bias", (tracked(3, 5), tracked(5), tracked(5, 1)), ShapeError),
        BadInput("negative eps", (tracked(3, 5),), ValueError, ("-1.0",), {"eps": -1.0}),
        BadInput("scalar", (tracked(),), ShapeError),
        BadInput("integer input", (integers(3, 5),), TypeError),
    ],
    rtol32=1e-4,
    atol32=1e-4,
)
def layer_norm(x: Any, weight: Any = None, bias: Any = None, eps: float = 1e-5) -> Tensor:
    """Layer norm over the last axis of ``x`` (any rank), biased variance;
    ``weight``/``bias`` of shape ``[D]`` are optional (records LayerNormBackward)."""
    op = "layer_norm"
    xv = array_of(x, op)
    require_float(op, xv)
    wv = _optional(weight, op, "weight")
    bv = _optional(bias, op, "bias")
    eps = _check_eps(op, eps)
    if xv.ndim < 1:
        raise ShapeError(f"{op}: expects a tensor of rank >= 1, got a scalar")
    d = xv.shape[-1]
    for name, p in (("weight", wv), ("bias", bv)):
        if p is not None and shape_of(p) != (d,):
            raise ShapeError(f"{op}: {name} must have shape ({d},) for input of shape {xv.shape}, got {shape_of(p)}")
    y, mean, rstd = kln.layer_norm_fwd(xv, wv, bv, eps)
    tape = tape_for(x, weight, bias)
    if tape is None:
        return Tensor._wrap(y)
    need_x, need_w = is_tracked(x), is_tracked(weight)
    saved_x, x_v = reads(x, need_x or need_w)
    saved_w, w_v = reads(weight, weight is not None and (need_x or need_w))  # dw needs to see a weight
    rec = LayerNormBackward(
        saved_x,
        x_v,
        saved_w,
        w_v,
        (mean, rstd),
        d,
        bias is not None,
        getattr(bv, "dtype", None),
        getattr(wv, "dtype", None),
    )
    return record(tape, rec, (x, weight, bias), new_output(y, tape))


def _chan(v: Array) -> Array:
    return v.reshape(1, -1, 1, 1)


@eager_jit(static_argnums=(4,))
def _running_update(rm: Array, rv: Array, mean: Array, var: Array, momentum: float) -> tuple[Array, Array]:
    """``(1 - m) * running + m * batch`` for the mean and the variance: eagerly
    one compiled call, where the dozen tiny ops it is made of cost a dispatch each."""
    m = jnp.asarray(momentum, rm.dtype)
    new_mean = ((1 - m) * rm + m * mean.astype(rm.dtype)).astype(rm.dtype)
    new_var = ((1 - m) * rv + m * var.astype(rv.dtype)).astype(rv.dtype)
    return new_mean, new_var


@frozen
class BatchNorm2dBackward(Record):
    """``y = (x - mean) * rstd * w + b`` per channel of ``x:[B, C, H, W]``.

    Training: ``mean``/``rstd`` are the batch statistics, which depend on ``x``.
    Eval: they are the running statistics (inputs 3 and 4), constants for ``x``;
    rumus got this mode's gradients wrong. Saves the input, the weight and the
    statistics used.
    """

    input: Array
    input_version: VersionSnapshot | None
    weight: Array | None
    weight_version: VersionSnapshot | None
    save: tuple[Array, Array]  # (mean, rstd) per channel, float32 for low precision
    running_version: tuple[VersionSnapshot | None, ...]  # eval: the statistics it normalised with
    stats_dtype: Any
    weight_dtype: Any
    training: bool
    channels: int
    has_bias: bool
    bias_dtype: Any = None  # the bias gradient's dtype (the kernels return g's)
    derived_fields = ("save",)

    derive_inputs = (3, 4)  # eval: the running statistics, which it does not save

    def derive(self, entry: Any, env: dict[int, Any]) -> BatchNorm2dBackward:
        """Training: the batch statistics as functions of the (substituted)
        input. Eval: the statistics as functions of the running mean and
        variance (inputs 3 and 4, tracers of the walk where tracked)."""
        if self.training:
            if self.input is None:
                return self
            return dataclasses.replace(self, save=_derived_stats(self.input, (0, 2, 3), *self.save))
        mean, rstd = self.save
        rm, rv = (env.get(g) if g is not None else None for g in entry.inputs[3:5])
        substituted = {(name, k) for name, k, gid in entry.provenance if gid is not None}
        if rm is not None and ("save", 0) not in substituted:
            mean = exact_value(mean, upcast(rm))
        if rv is not None:
            rvf = upcast(rv)
            r32 = rstd.astype(rvf.dtype)
            eps = jax.lax.stop_gradient(1 / (r32 * r32) - rvf)
            rstd = exact_value(rstd, jax.lax.rsqrt(rvf + eps))
        return dataclasses.replace(self, save=(mean, rstd))

    def backward(self, g, needs):
        mean, rstd = self.save
        x = self.input
        if self.training:
            if not (needs[0] or needs[1]):  # only the bias: the input was not saved
                return None, None, _bias_grad(g, (0, 2, 3), self.bias_dtype), None, None
            weight = _weight_for_dw(self.weight, needs[1], self.channels, self.weight_dtype)
            dx, dw, db = kbn.batch_norm_train_bwd(x, weight, mean, rstd, g, has_bias=self.has_bias and needs[2])
            db = _as_bias(db, self.bias_dtype) if needs[2] else None
            return (dx if needs[0] else None, dw if needs[1] else None, db, None, None)
        gf = upcast(g)
        # the weight is saved exactly when a needed gradient reads it
        dxhat = gf * _chan(upcast(self.weight)) if self.weight is not None else gf
        xc = upcast(x) - _chan(mean) if x is not None else None
        dx = (dxhat * _chan(rstd)).astype(g.dtype) if needs[0] else None
        dw = jnp.sum(gf * xc * _chan(rstd), axis=(0, 2, 3)).astype(self.weight_dtype) if needs[1] else None
        db = _as_bias(jnp.sum(gf, axis=(0, 2, 3)).astype(g.dtype), self.bias_dtype) if needs[2] else None
        d_mean = (-jnp.sum(dxhat, axis=(0, 2, 3)) * rstd).astype(self.stats_dtype) if needs[3] else None
        d_var = None
        if needs[4]:
            d_var = (-0.5 * jnp.sum(dxhat * xc, axis=(0, 2, 3)) * rstd**3).astype(self.stats_dtype)
        return dx, dw, db, d_mean, d_var


def ref_batch_norm(
    x: Any, w: Any, b: Any, rm: Any, rv: Any, *, training: bool, momentum: float = 0.1, eps: float = 1e-5
) -> tuple[Array, Array, Array]:
    """The jax.numpy oracle of ``batch_norm_2d`` (op table)."""
    c = lambda v: v.reshape(1, -1, 1, 1)  # noqa: E731
    if training:
        mean = jnp.mean(x, axis=(0, 2, 3))
        var = jnp.var(x, axis=(0, 2, 3))
    else:
        mean, var = rm, rv
    y = (x - c(mean)) / jnp.sqrt(c(var) + eps) * c(w) + c(b)
    if training:
        return y, (1 - momentum) * rm + momentum * mean, (1 - momentum) * rv + momentum * var
    return y, rm, rv


def _bn_samples(training: bool) -> Any:
    def gen(r: Any) -> list[Sample]:
        out = []
        for shape in [(3, 4, 5, 3), (2, 3, 1, 7)]:
            c = shape[1]
            out.append(
                Sample(
                    (normal(r, *shape), positive(r, c), normal(r, c), normal(r, c) * 0.1, positive(r, c)),
                    {"training": training},
                    diff=(0, 1, 2) if training else (0, 1, 2, 3, 4),
                )
            )
        return out

    return gen


def _bn_errors() -> list[BadInput]:
    x = tracked(2, 4, 3, 3)
    return [
        BadInput(
            "rank-3 input",
            (tracked(3, 4, 5), tracked(3), tracked(3), tracked(3), tracked(3)),
            ShapeError,
            ("(3, 4, 5)",),
            _TRAIN,
        ),
        BadInput("weight size", (x, tracked(3), tracked(4), tracked(4), tracked(4)), ShapeError, ("weight",), _TRAIN),
        BadInput(
            "running stats size",
            (x, tracked(4), tracked(4), tracked(5), tracked(4)),
            ShapeError,
            ("running_mean",),
            _EVAL,
        ),
        BadInput(
            "momentum above 1",
            (x, None, None, tracked(4), tracked(4)),
            ValueError,
            ("1.5",),
            {**_TRAIN, "momentum": 1.5},
        ),
        BadInput("training not a bool", (x, None, None, tracked(4), tracked(4)), TypeError, kwargs={"training": "yes"}),
        BadInput("negative eps", (x, None, None, tracked(4), tracked(4)), ValueError, kwargs={**_TRAIN, "eps": -1e-5}),
        BadInput(
            "one value per channel in training",
            (tracked(1, 4, 1, 1), None, None, tracked(4), tracked(4)),
            ValueError,
            (),
            _TRAIN,
        ),
        BadInput("integer input", (integers(2, 4, 3, 3), None, None, tracked(4), tracked(4)), TypeError, (), _TRAIN),
    ]


@eager_jit(static_argnums=(5,))
def _normalize_eval(xv: Array, wv: Any, bv: Any, rm: Array, rv: Array, eps: float) -> tuple[Array, Array, Array]:
    """(y, mean, 1/std) of batch norm with the running statistics."""
    mean = upcast(rm)
    rstd = lax.rsqrt(upcast(rv) + eps)
    yf = (upcast(xv) - _chan(mean)) * _chan(rstd)
    if wv is not None:
        yf = yf * _chan(upcast(wv))
    if bv is not None:
        yf = yf + _chan(upcast(bv))
    return yf.astype(xv.dtype), mean, rstd


_TRAIN, _EVAL = {"training": True}, {"training": False}
_BN_TABLE = dict(
    records=(BatchNorm2dBackward,), ref=ref_batch_norm, output=lambda out: out[0], rtol32=1e-4, atol32=1e-4
)


@op(name="batch_norm_2d_eval", samples=_bn_samples(False), **_BN_TABLE)
@op(name="batch_norm_2d_train", samples=_bn_samples(True), errors=_bn_errors, **_BN_TABLE)
def batch_norm_2d(
    x: Any,
    weight: Any,
    bias: Any,
    running_mean: Any,
    running_var: Any,
    *,
    training: bool,
    momentum: float = 0.1,
    eps: float = 1e-5,
) -> tuple[Tensor, Tensor, Tensor]:
    """Batch norm of ``x:[B, C, H, W]`` per channel -> ``(y, new_mean, new_var)``.

    ``training=True`` normalises with the batch statistics (biased variance) and
    returns running statistics updated as rumus does,
    ``(1 - momentum) * running + momentum * batch`` (biased batch variance);
    ``training=False`` normalises with the running statistics and returns them
    unchanged. The new statistics are untracked tensors (buffers, as PyTorch's).
    ``weight``/``bias`` may be None. In eval mode the running statistics are
    inputs of ``y`` and get gradients when tracked (records BatchNorm2dBackward).
    """
    op = "batch_norm_2d"
    xv = array_of(x, op)
    require_float(op, xv)
    if xv.ndim != 4:
        raise ShapeError(f"{op}: expects x of shape [B, C, H, W], got {xv.shape}")
    if not isinstance(training, bool):
        raise TypeError(f"{op}: training must be a bool, got {training!r}")
    eps = _check_eps(op, eps)
    if not is_real_scalar(momentum) or not 0 <= momentum <= 1:
        raise ValueError(f"{op}: momentum must be a float in [0, 1], got {momentum!r}")
    b, c, h, w = xv.shape
    wv = _optional(weight, op, "weight")
    bv = _optional(bias, op, "bias")
    rm = array_of(running_mean, op, "running_mean")
    rv = array_of(running_var, op, "running_var")
    for name, p in (("weight", wv), ("bias", bv), ("running_mean", rm), ("running_var", rv)):
        if p is not None and shape_of(p) != (c,):
            raise ShapeError(f"{op}: {name} must have shape ({c},) for x of shape {xv.shape}, got {shape_of(p)}")
    if training:
        if b * h * w < 2:
            raise ValueError(f"{op}: training needs more than one value per channel, got x of shape {xv.shape}")
        y, mean, var, rstd = kbn.batch_norm_train_fwd(xv, wv, bv, eps)
        new_mean, new_var = _running_update(rm, rv, mean, var, float(momentum))
        save = (mean, rstd)
    else:
        y, mean, rstd = _normalize_eval(xv, wv, bv, rm, rv, eps)
        new_mean, new_var = rm, rv
        save = (mean, rstd)
    stats = (Tensor._wrap(new_mean), Tensor._wrap(new_var))
    inputs = (x, weight, bias) if training else (x, weight, bias, running_mean, running_var)
    tape = tape_for(*inputs)
    if tape is None:
        return (Tensor._wrap(y), *stats)
    need_x, need_w = is_tracked(x), is_tracked(weight)
    running_versions: tuple = ()
    if training:  # dx and dw read x_hat; dx reads w
        saved_x, x_v = reads(x, need_x or need_w)
        saved_w, w_v = reads(weight, weight is not None and (need_x or need_w))  # dw needs to see a weight
    else:  # dw and d(running_var) read x; dx and d(running stats) read w
        need_rm, need_rv = is_tracked(running_mean), is_tracked(running_var)
        saved_x, x_v = reads(x, need_w or need_rv)
        saved_w, w_v = reads(weight, weight is not None and (need_x or need_w or need_rm or need_rv))
        # backward reads the running statistics it normalised with
        running_versions = (reads(running_mean, True)[1], reads(running_var, True)[1])
    rec = BatchNorm2dBackward(
        saved_x,
        x_v,
        saved_w,
        w_v,
        save,
        running_versions,
        rv.dtype,
        getattr(wv, "dtype", None),
        training,
        c,
        bias is not None,
        getattr(bv, "dtype", None),
    )
    out = record(tape, rec, (x, weight, bias, running_mean, running_var), new_output(y, tape))
    return (out, *stats)
