"""Version shims for the Pallas APIs the kernels use (jax 0.11.x and 0.12.x).

Names moved between releases (`TritonCompilerParams` -> `triton.CompilerParams`,
`TPUCompilerParams` -> `tpu.CompilerParams`, `InterpretParams` appearing), so every kernel
builds its compiler parameters here and nowhere else.
"""

import functools

import jax


@functools.cache
def _triton_module():
  from jax.experimental.pallas import triton as plgpu  # pylint: disable=g-import-not-at-top

  return plgpu


@functools.cache
def _mosaic_gpu_module():
  from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top

  return plgpu


@functools.cache
def _tpu_module():
  from jax.experimental.pallas import tpu as pltpu  # pylint: disable=g-import-not-at-top

  return pltpu


def triton_load(ref, *, mask=None, other=None):
  """Masked load through the Triton lowering's `load` (masked lanes read no memory)."""
  return _triton_module().load(ref, mask=mask, other=other)


def triton_store(ref, value, *, mask=None):
  """Masked store through the Triton lowering's `store` (masked lanes write nothing)."""
  _triton_module().store(ref, value, mask=mask)


def triton_compiler_params(num_warps: int, num_stages: int):
  plgpu = _triton_module()
  params_class = getattr(plgpu, "CompilerParams", None) or plgpu.TritonCompilerParams
  return params_class(num_warps=num_warps, num_stages=num_stages)


def mosaic_gpu_compiler_params(**settings):
  """Warpgroup semantics: arrays are per warpgroup and Mosaic GPU infers their register layouts
  (the style of jax's own Hopper kernels). `settings` are further CompilerParams fields."""
  plgpu = _mosaic_gpu_module()
  return plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup, **settings)


def mosaic_gpu_interpret_params():
  """What a Mosaic GPU kernel takes as `interpret=` to run on CPU: buffers the kernel allocates,
  its outputs included, start as NaN, so an element it never writes shows."""
  return _mosaic_gpu_module().InterpretGPUParams()


def finished_if_interpreted(outputs, interpret: bool):
  """`outputs` of a Pallas kernel (Mosaic GPU or TPU), waited for when an interpreter ran it (and
  no trace holds them: under one this returns at once).

  The Mosaic GPU and TPU interpreters run jax computations inside their own callbacks (on jax
  0.11.2 Mosaic GPU's `wait_smem_to_gmem` compares a queue length with `n`, which arrives as a jax
  Array; the TPU interpreter's `get` unstacks an index array). The CPU client bounds the
  executions in flight; when the calling thread dispatches more work before the kernel's
  execution has ended, that work can take the slots a callback's computation needs, and nothing
  finishes: on jax 0.11.2 on a loaded 2-core CPU the 4th to 17th eager call hung while the caller
  computed a reference, and none in 80 with this wait (KERNEL_NOTES v39)."""
  return jax.block_until_ready(outputs) if interpret else outputs


def waits_when_interpreted(jitted_function):
  """Decorates a jitted kernel entry point (one taking `interpret=`) with an eager layer that
  passes its outputs through `finished_if_interpreted`; the same arguments, name and docstring."""

  @functools.wraps(jitted_function)
  def entry_point(*args, **kwargs):
    outputs = jitted_function(*args, **kwargs)
    return finished_if_interpreted(outputs, kwargs.get("interpret", False))

  return entry_point


def tpu_compiler_params(dimension_semantics: tuple[str, ...], *, own_copies_in_bounds=False):
  """`own_copies_in_bounds`: the kernel's own copies (`make_async_copy` of dynamic slices) are in
  bounds by construction, so Mosaic's run-time checks of their offsets (a compare, a predicate
  and a halt per bound and copy, on the scalar unit of every grid step) are left out."""
  pltpu = _tpu_module()
  params_class = getattr(pltpu, "CompilerParams", None) or pltpu.TPUCompilerParams
  if own_copies_in_bounds:
    return params_class(dimension_semantics=dimension_semantics, disable_bounds_checks=True)
  return params_class(dimension_semantics=dimension_semantics)


def tpu_interpret_params():
  """What `pallas_call(interpret=...)` takes to run a TPU kernel on CPU."""
  params_class = getattr(_tpu_module(), "InterpretParams", None)
  return params_class() if params_class is not None else True


def prefetch_scalar_grid_spec(**kwargs):
  return _tpu_module().PrefetchScalarGridSpec(**kwargs)


def tpu_vmem_scratch(shape, dtype):
  pltpu = _tpu_module()
  vmem = getattr(pltpu, "VMEM", None)
  if vmem is None:  # older spelling
    vmem = pltpu.TPUMemorySpace.VMEM
  return vmem(shape, dtype)


def _first_device_attribute(name: str):
  """Attribute `name` of the first device, None where it lacks one or no device answers."""
  try:
    return getattr(jax.devices()[0], name, None)
  except Exception:  # pylint: disable=broad-except
    return None


def gpu_multiprocessor_count(default: int = 132) -> int:
  """SM count of the first GPU (used to size the flash-decoding split), or `default`."""
  count = _first_device_attribute("core_count")
  return int(count) if count else default


def gpu_compute_capability() -> str | None:
  """Compute capability of the first device ("9.0" on an H100 / H200), None where it has none."""
  capability = _first_device_attribute("compute_capability")
  return str(capability) if capability else None


def tpu_dma_semaphores(shape):
  """Scratch: an array of DMA semaphores of `shape`, for a TPU kernel's own copies."""
  return _tpu_module().SemaphoreType.DMA(shape)


def tpu_async_copy(source, target, semaphore):
  """A TPU kernel's copy of `source` into `target` signalling `semaphore` (`start`, `wait`)."""
  return _tpu_module().make_async_copy(source, target, semaphore)


def tpu_hbm_memory_space():
  """The memory space of a pallas_call operand kept in HBM for the kernel's own copies."""
  return _tpu_module().MemorySpace.HBM


def tpu_kept_in_hbm(array):
  """`array` as a pallas_call operand XLA must leave in HBM. (Without it, XLA placed GEAR's
  5-8 MiB outliers and rank-2 factors in a v5e's VMEM, where the kernel's copies from an HBM
  operand became loops of vector loads and stores: KERNEL_NOTES v58.)"""
  pltpu = _tpu_module()
  return pltpu.with_memory_space_constraint(array, pltpu.MemorySpace.HBM)
