"""Parametrizing a test over methods and layer loops: each method in one loop by default and in
the other under `-m slow` (the scan and the unrolled loop call the same cache code, and each
pair compiles programs of its own)."""

import pytest

OTHER_LAYER_LOOP = {"unroll": "scan", "scan": "unroll"}


def each_in_one_layer_loop(cases) -> list:
  """(spec, layer_loop) params from (spec, default layer_loop) pairs: the pairs as given, then
  each spec in the other loop, marked slow."""
  cases = list(cases)
  return cases + [
    pytest.param(spec, OTHER_LAYER_LOOP[layer_loop], marks=pytest.mark.slow)
    for spec, layer_loop in cases
  ]
