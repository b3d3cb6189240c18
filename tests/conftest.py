"""Strict settings for the whole suite: silent rank promotion, implicit dtype
promotion and warnings fail (a test that mixes dtypes on purpose says so with
``jax.numpy_dtype_promotion("standard")``)."""

import os
import shutil
import subprocess
import sys
import tempfile

# XLA's compile-time options for the test run, set before jax starts its CPU backend
# (the xdist workers and the child processes the tests start inherit them). The suite
# compiles thousands of small programs and XLA's compile is most of its time: with
# XLA:CPU's older loop emitters for fusions and LLVM at -O1, one program compiles in
# about 47 ms instead of 75 (2 cores, jax 0.10.2, 2026-12-06). Neither option turns on
# fast math: floating-point results keep their IEEE semantics, and the compiled oracle
# and rf's programs are built alike. "off" in the variable: XLA's defaults. An XLA that
# does not know an option aborts on it, so they are tried first in a child process and
# left out where it fails (a newer jax that dropped the older emitters).
TEST_XLA_FLAGS = "RUMUS_FX_TEST_XLA_FLAGS"
FAST_COMPILE_FLAGS = ("--xla_cpu_use_fusion_emitters=false", "--xla_backend_optimization_level=1")


def _fast_compile_flags() -> None:
    flags = os.environ.get("XLA_FLAGS", "")
    # an option already in XLA_FLAGS, with whatever value, is left as it is
    missing = [f for f in FAST_COMPILE_FLAGS if f.split("=")[0] + "=" not in flags]
    if os.environ.get(TEST_XLA_FLAGS) in ("off", "tried") or not missing:
        return
    os.environ[TEST_XLA_FLAGS] = "tried"  # once per run: the workers inherit the outcome
    wanted = " ".join([flags, *missing]).strip()
    probe = subprocess.run(
        [sys.executable, "-c", "import jax; jax.devices('cpu')"],
        env=dict(os.environ, XLA_FLAGS=wanted, JAX_PLATFORMS="cpu"),
        capture_output=True,
        timeout=300,
    )
    if probe.returncode == 0:
        os.environ["XLA_FLAGS"] = wanted


_fast_compile_flags()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from rumus_fx.lift.rules import load_library_rules  # noqa: E402

# the rules rf ships for other libraries' primitives (equinox) join the primitive
# table and the error audit when the library is installed
load_library_rules()

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_numpy_dtype_promotion", "strict")

# One persistent compilation cache for the whole run, shared by the xdist workers: the
# suite compiles many programs whose HLO another test (or the other worker) has already
# compiled, and XLA's compile is most of its time (the default run was 15 % faster with
# it: 37.0 against 43.6 min on one machine, 2026-12-06). Unset: a fresh directory for
# this run, removed at its end; a path: that directory, kept (a second run then
# compiles far less); "off": no persistent cache.
# The cache only skips compiling a program identical to one already compiled; it
# changes no result.
COMPILE_CACHE = "RUMUS_FX_TEST_COMPILE_CACHE"
_created_cache: str | None = None


def pytest_configure(config):
    global _created_cache
    where = os.environ.get(COMPILE_CACHE)
    if where == "off":
        return
    if where is None:  # the first process of the run (the xdist workers inherit the variable)
        where = _created_cache = tempfile.mkdtemp(prefix="rumus-fx-test-xla-cache-")
        os.environ[COMPILE_CACHE] = where
    jax.config.update("jax_compilation_cache_dir", where)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def pytest_unconfigure(config):
    if _created_cache is not None:
        shutil.rmtree(_created_cache, ignore_errors=True)


@pytest.fixture
def rng():
    return np.random.default_rng(0)


@pytest.fixture
def x64():
    """Run a test with 64-bit types enabled."""
    with jax.enable_x64(True):
        yield


# The smoke tier (``python -m pytest -m smoke``): one quick test per subsystem, for a first
# check in under two minutes on 2 cores. A parametrized test contributes its first case that is
# not marked slow.
SMOKE = (
    "tests/test_tensor.py::test_transpose_T_detach_are_views",
    "tests/test_storage.py::test_versions_start_at_zero_and_count_writes",
    "tests/test_tape.py::test_str_table_and_saved_bytes",
    "tests/test_versions.py::test_mismatch_on_saved_input",
    "tests/test_transforms.py::test_grad_pytrees_match_jax",
    "tests/test_no_silent_gradient.py::test_wrapped_arguments_are_leaves_that_require_grad",
    "tests/ops/test_optable.py::test_grad_matches_jax",
    "tests/ops/test_special.py::test_batch_norm_gradients_both_modes",
    "tests/ops/test_second_order.py::test_third_order",
    "tests/ops/test_create_graph.py::test_gradients_are_arrays_without_create_graph_and_tensors_with",
    "tests/lift/test_ptable.py::test_rule_matches_jax_grad",
    "tests/lift/test_programs.py::test_pure_jnp_mlp",
    "tests/lift/test_programs.py::test_scan_tape_length_independent_of_length",
    "tests/lift/test_namespaces.py::test_names_mirror_jax",
    "tests/kernels/test_dispatch.py::test_modes_context_and_environment",
    "tests/kernels/test_ops_interpret.py::test_rf_grad_matches_reference",
    "tests/nn/test_layers.py::test_linear_matches_jnp",
    "tests/nn/test_transformer.py::test_transformer_block_params_layout",
    "tests/nn/test_serialization.py::test_round_trip_with_like_restores_structure_and_dtypes",
    "tests/nn/test_torch_state.py::test_square_linear_weight_is_transposed",
    "tests/test_sharding.py::test_norm_weight_gradient_with_untracked_input",
    "tests/test_anomaly.py::test_eager_names_record_index_and_shapes",
    "tests/test_lazy.py::test_ops_defer_and_values_wait_for_a_read",
    "tests/test_whole_tape.py::test_repeated_tape_gives_the_same_gradients_compiled_or_not",
    "tests/test_errors_audit.py::test_primitive_error_cases_are_declared",
    "tests/test_display.py::test_tape_entry_and_tensor_html",
    "tests/test_readme.py::test_tape_example_runs",
    "tests/test_docs_site.py::test_every_public_name_has_an_api_entry",
    "tests/test_packaging.py::test_version_agrees_with_pyproject_and_changelog",
)


def pytest_collection_modifyitems(config, items):
    wanted = set(SMOKE)
    found: set[str] = set()
    files = {item.nodeid.split("::", 1)[0] for item in items}
    for item in items:
        name = item.nodeid.split("[", 1)[0]
        heavy = item.get_closest_marker("slow") or item.get_closest_marker("fuzz_long")
        if name in wanted and name not in found and not heavy:
            found.add(name)
            item.add_marker(pytest.mark.smoke)
    # a renamed or removed test must not silently drop out of the tier
    lost = [n for n in SMOKE if n.split("::", 1)[0] in files and n not in found]
    if lost and "smoke" in (config.getoption("markexpr", "") or ""):
        raise pytest.UsageError(f"tests/conftest.py SMOKE names tests that were not collected: {lost}")
