"""Loading a script of benchmarks/ as a module in the tests (benchmarks/ is not a package; its
scripts import each other by name, so it is on sys.path while one loads)."""

import importlib.util
import pathlib
import sys

BENCHMARKS = pathlib.Path(__file__).parents[2] / "benchmarks"


def load_benchmark(name: str):
  """benchmarks/<name>.py as a module."""
  spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  sys.path.insert(0, str(BENCHMARKS))
  try:
    spec.loader.exec_module(module)
  finally:
    sys.path.remove(str(BENCHMARKS))
  return module
