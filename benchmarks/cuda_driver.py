"""The few CUDA driver API calls a benchmark needs to run a prebuilt cubin, through ctypes.

For compile-only experiments written in CUDA C++ (`warp_products_experiment.cu`): the GPU machine
has the driver (libcuda) and numpy, not necessarily nvcc or a CUDA Python package, so the cubin
is built on a machine with nvcc and loaded here. Every call's status is checked; a failure names
the call and the driver's error name.
"""

import ctypes

CU_EVENT_DEFAULT = 0


class CudaError(RuntimeError):
  pass


class Driver:
  """One device's primary context, made current on creation."""

  def __init__(self, device: int = 0):
    self._lib = ctypes.CDLL("libcuda.so.1")
    self._check("cuInit", 0)
    handle = ctypes.c_int()
    self._check("cuDeviceGet", ctypes.byref(handle), device)
    self.device = handle.value
    self._context = ctypes.c_void_p()
    self._check("cuDevicePrimaryCtxRetain", ctypes.byref(self._context), self.device)
    self._check("cuCtxSetCurrent", self._context)

  def _check(self, name: str, *args) -> None:
    status = getattr(self._lib, name)(*args)
    if status != 0:
      text = ctypes.c_char_p()
      self._lib.cuGetErrorName(status, ctypes.byref(text))
      raise CudaError(f"{name} failed: {text.value.decode() if text.value else status}")

  def name(self) -> str:
    buffer = ctypes.create_string_buffer(256)
    self._check("cuDeviceGetName", buffer, 256, self.device)
    return buffer.value.decode()

  def load_function(self, cubin: bytes, name: str) -> ctypes.c_void_p:
    module, function = ctypes.c_void_p(), ctypes.c_void_p()
    self._check("cuModuleLoadData", ctypes.byref(module), ctypes.c_char_p(cubin))
    self._check("cuModuleGetFunction", ctypes.byref(function), module, name.encode())
    return function

  def alloc(self, nbytes: int) -> int:
    pointer = ctypes.c_uint64()
    self._check("cuMemAlloc_v2", ctypes.byref(pointer), ctypes.c_size_t(nbytes))
    return pointer.value

  def free(self, pointer: int) -> None:
    self._check("cuMemFree_v2", ctypes.c_uint64(pointer))

  def fill32(self, pointer: int, value: int, count: int) -> None:
    """Sets `count` 32-bit words from `pointer` to the bit pattern `value`."""
    self._check(
      "cuMemsetD32_v2", ctypes.c_uint64(pointer), ctypes.c_uint(value), ctypes.c_size_t(count)
    )

  def upload(self, pointer: int, array) -> None:
    """Copies a C-contiguous numpy array to device memory at `pointer`."""
    self._check(
      "cuMemcpyHtoD_v2",
      ctypes.c_uint64(pointer),
      array.ctypes.data_as(ctypes.c_void_p),
      ctypes.c_size_t(array.nbytes),
    )

  def download(self, array, pointer: int) -> None:
    """Fills a C-contiguous numpy array from device memory at `pointer`."""
    self._check(
      "cuMemcpyDtoH_v2",
      array.ctypes.data_as(ctypes.c_void_p),
      ctypes.c_uint64(pointer),
      ctypes.c_size_t(array.nbytes),
    )

  def copy(self, destination: int, source: int, nbytes: int) -> None:
    self._check(
      "cuMemcpyDtoD_v2",
      ctypes.c_uint64(destination),
      ctypes.c_uint64(source),
      ctypes.c_size_t(nbytes),
    )

  def launch(self, function, grid: tuple, block: tuple, parameters: ctypes.Structure) -> None:
    """Launches `function` with one by-value parameter, the struct `parameters`."""
    arguments = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.pointer(parameters), ctypes.c_void_p))
    self._check(
      "cuLaunchKernel",
      function,
      *(ctypes.c_uint(n) for n in grid),
      *(ctypes.c_uint(n) for n in block),
      ctypes.c_uint(0),
      ctypes.c_void_p(0),
      arguments,
      ctypes.c_void_p(0),
    )

  def synchronize(self) -> None:
    self._check("cuCtxSynchronize")

  def milliseconds(self, work, repeat: int) -> float:
    """Device milliseconds of `repeat` back-to-back runs of `work()` (which enqueues work on the
    default stream), by events around them."""
    start, end = ctypes.c_void_p(), ctypes.c_void_p()
    self._check("cuEventCreate", ctypes.byref(start), CU_EVENT_DEFAULT)
    self._check("cuEventCreate", ctypes.byref(end), CU_EVENT_DEFAULT)
    self._check("cuEventRecord", start, ctypes.c_void_p(0))
    for _ in range(repeat):
      work()
    self._check("cuEventRecord", end, ctypes.c_void_p(0))
    self._check("cuEventSynchronize", end)
    elapsed = ctypes.c_float()
    self._check("cuEventElapsedTime", ctypes.byref(elapsed), start, end)
    self._check("cuEventDestroy_v2", start)
    self._check("cuEventDestroy_v2", end)
    return elapsed.value
