import pathlib
import sys

import jax
import pytest

# Tests import the repository's packages from the checkout, installed or not.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

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
