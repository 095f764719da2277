"""How many programs an H100 / H200 SM (sm_90) holds at once, by CUDA's occupancy rules: the
fewest its registers, its shared memory and its warp slots allow."""

REGISTERS_PER_SM = 65536
REGISTER_GRANULE = 8  # registers per thread are allocated in steps of 8 (256 per warp)
SHARED_BYTES_PER_SM = 233472
SHARED_BYTES_RESERVED_PER_PROGRAM = 1024  # the driver's, beside the kernel's own
WARPS_PER_SM = 64
THREADS_PER_WARPGROUP = 128


def programs_per_sm(registers: int, shared_bytes: int, warpgroups: int = 1) -> int:
  """Programs of `warpgroups` warpgroups an SM can hold at once."""
  granted = -(-registers // REGISTER_GRANULE) * REGISTER_GRANULE
  threads = THREADS_PER_WARPGROUP * warpgroups
  return min(
    REGISTERS_PER_SM // (granted * threads),
    SHARED_BYTES_PER_SM // (shared_bytes + SHARED_BYTES_RESERVED_PER_PROGRAM),
    WARPS_PER_SM // (threads // 32),
  )
