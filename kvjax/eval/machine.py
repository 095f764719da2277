"""A readable name of the machine results were measured on."""

import os
import pathlib
import platform

import jax


def cpu_name() -> str:
  """The CPU model (Linux reports it in /proc/cpuinfo; `platform.processor()` is often empty)."""
  try:
    for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
      if line.startswith("model name"):
        return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def usable_cpus() -> int:
  """CPUs this process may run on: fewer than the machine's under `taskset` or a container's
  CPU set, and the speed results are those of these."""
  try:
    return len(os.sched_getaffinity(0))
  except (AttributeError, OSError):  # not Linux
    return os.cpu_count() or 1


def machine_description() -> str:
  """e.g. `AMD EPYC 9B14, 2 CPUs; jax 0.12.0 on cpu (cpu)`."""
  device = jax.devices()[0]
  return (
    f"{cpu_name()}, {usable_cpus()} CPUs; jax {jax.__version__} on {jax.default_backend()} "
    f"({device.device_kind})"
  )
