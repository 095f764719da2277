"""Fixtures of the kernel tests."""

import dataclasses

import jax
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import _compat
from tests.pallas_kernels.kernel_checks import tpu_interpret


@pytest.fixture
def tpu_races(monkeypatch):
  """Runs the test's TPU kernels in interpret mode on two TensorCores (the grid's parallel axes
  split between them, as on a v4 or v5p) under the interpreter's happens-before race detector,
  each copy landing when it starts (`dma_execution_mode="eager"`): a read of a buffer a copy
  writes, not ordered after its wait, is a race. Yields a function that says whether the calls
  since found one (jax 0.11.2 prints races and cannot raise them; jax 0.12 is told to warn, so
  both run to the end). jax's caches are cleared before and after: a kernel traced by an
  earlier test with the same shapes would otherwise run as it was traced, without the
  detector (and one traced here would be reused after it)."""
  if not tpu_interpret():
    pytest.skip("the race detector is the interpreter's")
  from jax._src.pallas.mosaic.interpret import interpret_pallas_call

  fields = {field.name for field in dataclasses.fields(pltpu.InterpretParams)}
  params = dict(detect_races=True, num_cores_or_threads=2, dma_execution_mode="eager")
  if "on_race" in fields:
    params["on_race"] = "warn"
  pltpu.reset_tpu_interpret_mode_state()
  jax.clear_caches()
  monkeypatch.setattr(_compat, "tpu_interpret_params", lambda: pltpu.InterpretParams(**params))
  yield lambda: bool(interpret_pallas_call.races and interpret_pallas_call.races.races_found)
  jax.clear_caches()
  pltpu.reset_tpu_interpret_mode_state()
