import os
import pathlib
import shutil
import sys
import tempfile

# Set before jax is imported, so every test process's XLA (xdist workers and the subprocesses
# that inherit this environment) reads them. Most of a test's time is XLA compiling small programs
# for the CPU, which then run for milliseconds: LLVM's full optimisation buys nothing there. These
# two took a compile-bound subset (test_compressed_context + test_shared_context_cache) from 142 s
# to 86 s on a 2-core machine. Flags the caller already set win; KVJAX_TESTS_FAST_COMPILE=0 leaves
# XLA's defaults. The caller's own XLA_FLAGS are kept in KVJAX_TESTS_CALLER_XLA_FLAGS, so that a
# test starting a subprocess can start from them rather than from these.
_FAST_COMPILE_FLAGS = {
  "--xla_backend_optimization_level": "0",
  "--xla_llvm_disable_expensive_passes": "true",
}
FAST_COMPILE_SWITCH = "KVJAX_TESTS_FAST_COMPILE"
CALLER_FLAGS_VARIABLE = "KVJAX_TESTS_CALLER_XLA_FLAGS"
_caller_flags = os.environ.setdefault(CALLER_FLAGS_VARIABLE, os.environ.get("XLA_FLAGS", ""))
_fast_compile_setting = os.environ.get(FAST_COMPILE_SWITCH, "1")
if _fast_compile_setting not in ("0", "1"):
  raise ValueError(
    f"{FAST_COMPILE_SWITCH}={_fast_compile_setting!r}: allowed values are 0 (XLA's default "
    "optimisation) and 1 (the default: fast compile flags)"
  )
_fast_compile = _fast_compile_setting == "1"
os.environ["XLA_FLAGS"] = " ".join(
  [_caller_flags]
  + [
    f"{flag}={value}"
    for flag, value in _FAST_COMPILE_FLAGS.items()
    if _fast_compile and flag not in _caller_flags
  ]
).strip()

# The dev extra installs libtpu (to compile the TPU kernels without a TPU). With it, a process
# that starts jax on a machine without a TPU first tries to open one and logs why it could not;
# the tests run on the CPU (or, with KVJAX_NATIVE_KERNELS=1, on the machine's accelerator).
# libtpu also takes a lock file per process unless told several processes may load it, and
# the xdist workers each build a compile-only TPU topology.
if os.environ.get("KVJAX_NATIVE_KERNELS", "0") != "1":
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import pytest  # noqa: E402

# Tests import the repository's packages from the checkout, installed or not.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

# Many tests compile the same programs (each method's generate on the tiny model, in the method
# matrix and again in the chunked-prefill, room and kernel tests), on fresh decoder objects that
# jit's in-memory cache cannot match. XLA's persistent cache, keyed by the program itself, lets
# one compile serve them all. The directory lives for one run (shared by its xdist workers,
# which inherit this variable) so that every run compiles from nothing, as CI does.
_COMPILATION_CACHE_VARIABLE = "KVJAX_TESTS_COMPILATION_CACHE"


def pytest_configure(config):
  if _COMPILATION_CACHE_VARIABLE not in os.environ:
    os.environ[_COMPILATION_CACHE_VARIABLE] = tempfile.mkdtemp(prefix="kvjax-tests-xla-")
    config._kvjax_owns_compilation_cache = True
  jax.config.update("jax_compilation_cache_dir", os.environ[_COMPILATION_CACHE_VARIABLE])
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def pytest_unconfigure(config):
  if getattr(config, "_kvjax_owns_compilation_cache", False):
    shutil.rmtree(os.environ.pop(_COMPILATION_CACHE_VARIABLE), ignore_errors=True)


# XLA on CPU keeps every compiled executable's code in memory mappings of its own (~270 per
# interpret-mode kernel test). Linux caps a process at vm.max_map_count of them (65530 by
# default), and the compile that crosses the cap segfaults: the slow kernel grids reached it
# after ~230 tests in one process. Past this many mappings the compiled programs are dropped.
_MAPPINGS_BEFORE_CLEARING = 40_000
_MAPS = pathlib.Path("/proc/self/maps")


@pytest.fixture(autouse=True)
def _release_compiled_programs_near_the_mapping_cap():
  yield
  if _MAPS.exists():
    with _MAPS.open() as maps:
      if sum(1 for _ in maps) > _MAPPINGS_BEFORE_CLEARING:
        jax.clear_caches()
