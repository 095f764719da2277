"""Static cost of the GPU (Triton) decode kernels on a machine without a GPU.

Lowers a kernel to Triton IR through jax's Pallas-Triton lowering (the target GPU is faked by
patching jax's private device-info lookup, as tests/pallas_kernels/test_lowering.py does),
compiles that IR for sm_90 (H100/H200) with the `triton` package's own pass pipeline and ptxas,
disassembles the cubin, and reads off the kernel's main loop (the longest backward branch):

  - warp instructions per loop iteration, by opcode, and per cached element;
  - shared-memory wavefronts per iteration (LDS/STS by width, ldmatrix/stmatrix by count, the
    operand tiles a warpgroup MMA reads from shared memory once per warpgroup; assuming no bank
    conflicts) and CTA barriers;
  - registers per thread, shared memory per program, layout conversions left in the TTGIR;
  - two floors for the benchmark shape: instruction issue (4 schedulers x 1 warp instruction per
    clock per SM) and shared-memory bandwidth (1 wavefront per clock per SM).

These are predictions from the compiled code, not timings: the real kernel also waits on memory,
latency and barriers, and on the GPU jaxlib's own Triton (not this `triton` release) compiles
it, so the SASS can differ. Use it to compare variants between GPU sessions;
`benchmarks/decode_attention.py` on a GPU is the measurement.

Needs `pip install -e ".[kernel-analysis]"` (triton 3.9.0, which gave the numbers in
KERNEL_NOTES.md; nothing else from CUDA, no GPU). Example:

  PYTHONPATH=. python benchmarks/triton_static_cost.py --variants reshape joined --bf16
"""

import argparse
import collections
import contextlib
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass

H100_SMS = 132
H100_CLOCK_HZ = 1.755e9  # sustained SM clock under load (the KERNEL_NOTES arithmetic)
SCHEDULERS_PER_SM = 4

SASS_LINE = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)([^;]*);")


WGMMA_SHAPE = re.compile(r"^HGMMA\.(\d+)x(\d+)x(\d+)\.")
WGMMA_OPERAND_BYTES = {"BF16": 2, "F16": 2, "TF32": 4, "E4M3": 1, "E5M2": 1}
WARPS_PER_WARPGROUP = 4


def wgmma_shared_wavefronts(opcode: str, operands: str) -> float:
  """One warp's share of the shared memory a warpgroup MMA reads through its descriptors
  (`gdesc`): B [K, N] always, A [M, K] when it is not in registers. The four warps of the
  warpgroup each issue the instruction; the tile is read once."""
  shape = WGMMA_SHAPE.match(opcode)
  if not shape:
    return 0.0
  m, n, k = (int(size) for size in shape.groups())
  element = WGMMA_OPERAND_BYTES[opcode.rsplit(".", 1)[1]]  # HGMMA.MxNxK.<accumulator>.<operands>
  sources = [field.strip() for field in operands.split(",")][1:3]  # A, B after the destination
  tile_bytes = sum(
    rows * k * element for rows, source in zip((m, n), sources) if source.startswith("gdesc")
  )
  return tile_bytes / 128 / WARPS_PER_WARPGROUP


def shared_memory_wavefronts(opcode: str, operands: str = "") -> float:
  """Wavefronts one warp instruction costs the shared-memory pipe (conflict-free)."""
  base = opcode.split(".")[0]
  if base == "HGMMA":
    return wgmma_shared_wavefronts(opcode, operands)
  if base in ("LDSM", "STSM"):
    count = re.search(r"\.(\d)$", opcode)
    return int(count.group(1)) if count else 1
  if base in ("LDS", "STS"):
    if ".128" in opcode:
      return 4
    if ".64" in opcode:
      return 2
    return 1
  return 0


def parse_sass(text: str) -> list[tuple[int, str, str]]:
  """(address, opcode, operands) for every instruction of a `cuobjdump -sass` listing."""
  instructions = []
  for line in text.splitlines():
    match = SASS_LINE.match(line)
    if match:
      instructions.append((int(match.group(1), 16), match.group(2), match.group(3)))
  return instructions


def main_loop_instructions(instructions) -> list[tuple[str, str]]:
  """(opcode, operands) of the longest backward-branch region (the kernel's main loop).
  Branches placed after the first EXIT are out-of-line stubs (Mosaic GPU's mbarrier try-wait
  retries jump back into the body from there) and bound no loop."""
  return [(opcode, operands) for _, opcode, operands in main_loop(instructions)]


# The low two bits of the warp index tested into a predicate: `pl.when(warp == 0)` inside
# `plgpu.warp_map` (warp % 4 == 0), right before the branch that skips the other warps.
WARP_INDEX_TEST = re.compile(r"^\s*P\d+, RZ, R\d+, 0x3, RZ, 0xc0")


def branch_target(opcode: str, operands: str) -> int | None:
  """The address a BRA instruction jumps to; None for any other instruction."""
  target = re.search(r"0x([0-9a-f]+)", operands)
  return int(target.group(1), 16) if opcode.startswith("BRA") and target else None


def first_warp_only(loop) -> int:
  """Instructions of a loop body ((address, opcode, operands), as `main_loop` gives) that only
  the first warp of the warpgroup runs: those a forward branch skips right after a test of the
  warp index (`WARP_INDEX_TEST`)."""
  skipped = set()
  for (_, opcode, operands), (address, next_opcode, next_operands) in zip(loop, loop[1:]):
    if not (opcode.startswith("LOP3") and WARP_INDEX_TEST.match(operands)):
      continue
    end = branch_target(next_opcode, next_operands)
    if end is not None and end > address:
      skipped |= {a for a, _, _ in loop if address < a < end}
  return len(skipped)


GUARDED_SASS_LINE = re.compile(
  r"^\s+/\*([0-9a-f]{4,})\*/\s+(?:@(!?)(U?P\w+)\s+)?([A-Z][A-Za-z0-9_.]*)([^;]*);"
)
# Where Mosaic GPU's `plgpu.warp_map` code reads and tests the warp index in SASS: the index is
# broadcast with a shuffle, masked to its low two bits, and compared with a constant.
_WARP_SHUFFLE = re.compile(r"^\s*PT, (R\d+), R\d+, RZ, 0x1f")
_WARP_MASK = re.compile(r"^\s*(R\d+|P\d+), (?:RZ, )?(R\d+), 0x3, RZ, 0xc0")
_WARP_COMPARE = re.compile(r"^\s*(P\d+), PT, (R\d+)(?:\.reuse)?, 0x([0-9a-f]+), PT")
# The warp index compared with a uniform register: a warp chosen per iteration (the warp Mosaic
# GPU kernel's copy_issuer="slot_owner": warp == slot % 4).
_WARP_COMPARE_UNIFORM = re.compile(r"^\s*(P\d+), PT, (R\d+)(?:\.reuse)?, (UR\d+), PT")
_PREDICATE_WRITE = re.compile(r"^\s*(P\d+),")


def parse_guarded_sass(text: str) -> dict[int, tuple[tuple[bool, str] | None, str, str]]:
  """{address: (guard, opcode, operands)}: guard (negated, predicate) of a predicated
  instruction (`@!P0 BRA ...`), None for one that always runs."""
  instructions = {}
  for line in text.splitlines():
    match = GUARDED_SASS_LINE.match(line)
    if match:
      address, negated, predicate, opcode, operands = match.groups()
      guard = (negated == "!", predicate) if predicate else None
      instructions[int(address, 16)] = (guard, opcode, operands)
  return instructions


def warp_path_lengths(
  sass: str, path=None, warps: int = 4, chosen: bool | None = None
) -> list[int]:
  """Instructions each warp of a warpgroup issues per loop iteration: the loop body (or `path`,
  one arm of it as `branch_paths` gives) walked once per warp index, with branches on the warp
  index (`plgpu.warp_map`'s tests) resolved for that warp and every other conditional branch
  on its steady-state side: not taken (the next block's fetch runs, barrier waits succeed at
  once), unless only its target is on `path`. `chosen`: how a comparison of the warp index with
  a uniform register (a warp chosen per iteration) comes out, equal (True) or not (False); None
  leaves it unresolved like any other branch. ValueError if a path meets an indirect branch
  (BRX: ptxas may turn a switch on the warp index into a jump table, whose targets the
  listing does not give)."""
  guarded = parse_guarded_sass(sass)
  path = path if path is not None else main_loop(parse_sass(sass))
  addresses = [address for address, _, _ in path]
  on_path = set(addresses)
  following = dict(zip(addresses, addresses[1:]))
  lengths = []
  for warp in range(warps):
    registers, predicates = {}, {}  # what is known of this warp's index in registers
    address, count = addresses[0], 0
    while address is not None:
      guard, opcode, operands = guarded[address]
      count += 1
      if address == addresses[-1]:  # the loop's backward branch
        break
      if opcode.startswith("BRX"):
        raise ValueError(f"an indirect branch at {address:#x}: its targets are not in the SASS")
      written = _PREDICATE_WRITE.match(operands)
      if written:
        predicates.pop(written.group(1), None)
      if opcode.startswith("SHFL.IDX") and (shuffle := _WARP_SHUFFLE.match(operands)):
        registers[shuffle.group(1)] = warp
      elif opcode.startswith("LOP3") and (mask := _WARP_MASK.match(operands)):
        destination, source = mask.groups()
        if source in registers:
          value = registers[source] & 3
          if destination.startswith("P"):
            predicates[destination] = value != 0
          else:
            registers[destination] = value
      elif opcode.startswith("ISETP") and (compare := _WARP_COMPARE.match(operands)):
        destination, source, constant = compare.groups()
        if source in registers and (".NE." in opcode or ".EQ." in opcode):
          equal = registers[source] == int(constant, 16)
          predicates[destination] = equal if ".EQ." in opcode else not equal
      elif (
        chosen is not None
        and opcode.startswith("ISETP")
        and (compare := _WARP_COMPARE_UNIFORM.match(operands))
      ):
        destination, source, _ = compare.groups()
        if source in registers and (".NE." in opcode or ".EQ." in opcode):
          predicates[destination] = chosen if ".EQ." in opcode else not chosen
      target = branch_target(opcode, operands)
      if target is None:
        address = following.get(address)
        continue
      if guard is None:
        taken = True
      elif guard[1] in predicates:
        taken = predicates[guard[1]] != guard[0]
      else:
        taken = target in on_path and following.get(address) not in on_path
      address = target if taken and target in on_path else following.get(address)
    lengths.append(count)
  return lengths


def slot_owner_warp_lengths(sass: str, path=None, warps: int = 4, stages: int = 4) -> list[float]:
  """Instructions each warp issues per loop iteration, averaged over the iterations, when ring
  slot s's work is warp s % warps's (a comparison of the warp index with a uniform register,
  `warp_path_lengths(chosen=...)`): warp w owns the slots s < stages with s % warps == w, so it
  takes the chosen path on that fraction of the iterations."""
  owning = warp_path_lengths(sass, path, warps, chosen=True)
  other = warp_path_lengths(sass, path, warps, chosen=False)
  lengths = []
  for warp in range(warps):
    share = sum(1 for slot in range(stages) if slot % warps == warp) / stages
    lengths.append(share * owning[warp] + (1 - share) * other[warp])
  return lengths


def main_loop(instructions, without: str | None = None) -> list[tuple[int, str, str]]:
  """(address, opcode, operands) of `main_loop_instructions`'s region; with `without` (an opcode
  prefix), of the longest loop whose body has no such instruction (a kernel of two loops, one per
  softmax path, as the warp Mosaic GPU kernel: the fixed reference's loop is the one without
  FMNMX)."""
  exit_address = min(
    (address for address, opcode, _ in instructions if opcode.startswith("EXIT")), default=None
  )
  loops = []
  for address, opcode, operands in instructions:
    if exit_address is not None and address > exit_address:
      break
    target = branch_target(opcode, operands)
    if target is not None and target < address:
      loops.append((target, address))
  if not loops:
    raise ValueError("no backward branch in the SASS: the kernel has no loop")
  region = lambda bounds: [i for i in instructions if bounds[0] <= i[0] <= bounds[1]]
  if without is not None:
    loops = [
      bounds
      for bounds in loops
      if not any(opcode.startswith(without) for _, opcode, _ in region(bounds))
    ]
    if not loops:
      raise ValueError(f"every loop of the SASS has a {without} instruction")
  return region(max(loops, key=lambda loop: loop[1] - loop[0]))


def branch_paths(loop) -> list[list[tuple[int, str, str]]]:
  """The two paths through a loop body ((address, opcode, operands), as `main_loop` gives)
  whose work is one two-armed branch (an if/else taken per iteration, as the folded Mosaic GPU
  kernel's row_max="bound" has): the instructions before the branch, one arm, and those after
  the arms join, for each arm. The branch is the first forward branch to a target t in the body
  whose preceding instruction is a branch forward past t (the first arm's jump to the join)."""
  by_address = {address: index for index, (address, _, _) in enumerate(loop)}
  for index, (address, opcode, operands) in enumerate(loop):
    else_start = branch_target(opcode, operands)
    if else_start is None or else_start <= address or else_start not in by_address:
      continue
    join_start = branch_target(*loop[by_address[else_start] - 1][1:])
    if join_start is None or join_start <= else_start or join_start not in by_address:
      continue
    before, after = loop[: index + 1], loop[by_address[join_start] :]
    return [
      before + loop[index + 1 : by_address[else_start]] + after,
      before + loop[by_address[else_start] : by_address[join_start]] + after,
    ]
  raise ValueError("no two-armed branch in the loop body")


def wgmma_shadows(body: list[tuple[str, str]]) -> list[int]:
  """For each warpgroup MMA in a loop body (WARPGROUP.ARRIVE up to its WARPGROUP.DEPBAR wait),
  the other instructions the warps issue in between: work that overlaps the tensor core
  instead of waiting for it."""
  shadows, open_count = [], None
  for opcode, _ in body:
    if opcode.startswith("WARPGROUP.ARRIVE"):
      open_count = 0
    elif opcode.startswith("WARPGROUP.DEPBAR"):
      if open_count is not None:
        shadows.append(open_count)
      open_count = None
    elif open_count is not None and not opcode.startswith("HGMMA"):
      open_count += 1
  return shadows


@dataclass
class LoopCost:
  name: str
  registers: int
  shared_bytes: int
  layout_conversions: int
  instructions: int  # warp instructions per loop iteration, per warp
  wavefronts: float  # shared-memory wavefronts per iteration, per warp
  barriers: int
  mma: int
  tokens_per_iteration: int
  warps: int
  opcodes: dict
  wgmma_shadows: list  # `wgmma_shadows`: instructions issued while each warpgroup MMA runs
  # of `instructions`, those only the first warp runs (`first_warp_only`)
  first_warp_only: int = 0
  # what each warp issues per iteration, where warps take different paths (`warp_path_lengths`)
  warp_instructions: list | None = None

  @property
  def mean_instructions(self) -> float:
    """Warp instructions per iteration, averaged over the warps (the first warp may run more)."""
    if self.warp_instructions:
      return sum(self.warp_instructions) / len(self.warp_instructions)
    return self.instructions - self.first_warp_only * (self.warps - 1) / self.warps

  def per_element(self, head_dim: int) -> float:
    """Thread instructions per cached K or V element (one lane of a warp instruction each)."""
    elements_per_warp = 2 * self.tokens_per_iteration * head_dim / self.warps
    return self.mean_instructions * 32 / elements_per_warp

  def floors_us(self, *, programs_tokens: int) -> dict:
    """Issue and shared-memory floors for `programs_tokens` = sum over programs of tokens."""
    iterations = programs_tokens / self.tokens_per_iteration
    warp_instructions = iterations * self.warps * self.mean_instructions
    wavefronts = iterations * self.warps * self.wavefronts
    return {
      "issue_us": 1e6 * warp_instructions / (H100_SMS * SCHEDULERS_PER_SM * H100_CLOCK_HZ),
      "shared_us": 1e6 * wavefronts / (H100_SMS * H100_CLOCK_HZ),
    }


def loop_cost(
  name,
  sass: str,
  resources: str,
  ttgir: str,
  *,
  tokens_per_iteration,
  warps,
  branch_arm=None,
  loop_without=None,
):
  """`branch_arm` 0 or 1: count the path through that arm of the body's branch
  (`branch_paths`) instead of the whole body; `loop_without`: the longest loop without that
  opcode (`main_loop`)."""
  loop = main_loop(parse_sass(sass), without=loop_without)
  if branch_arm is not None:
    loop = branch_paths(loop)[branch_arm]
  body_instructions = [(opcode, operands) for _, opcode, operands in loop]
  body = [opcode for opcode, _ in body_instructions]
  by_base = collections.Counter(opcode.split(".")[0] for opcode in body)
  registers = re.search(r"REG:(\d+)", resources)
  shared = re.search(r"SHARED:(\d+)", resources)
  return LoopCost(
    name=name,
    registers=int(registers.group(1)) if registers else -1,
    shared_bytes=int(shared.group(1)) if shared else -1,
    layout_conversions=ttgir.count("ttg.convert_layout"),
    instructions=len(body),
    wavefronts=sum(
      shared_memory_wavefronts(opcode, operands) for opcode, operands in body_instructions
    ),
    barriers=by_base["BAR"],
    mma=by_base["HMMA"] + by_base["HGMMA"],
    tokens_per_iteration=tokens_per_iteration,
    warps=warps,
    opcodes=dict(by_base.most_common(20)),
    wgmma_shadows=wgmma_shadows(body_instructions),
    first_warp_only=first_warp_only(loop),
  )


@contextlib.contextmanager
def pallas_triton_for_h100():
  """Pallas-Triton calls lower as for an H100 inside this block, with no GPU attached (jax's
  private device-info lookup is patched)."""
  from jax._src.pallas.triton import gpu_info, pallas_call_registration

  info = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H100)
  original_info = pallas_call_registration.gpu_info_lib.get_gpu_info
  pallas_call_registration.gpu_info_lib.get_gpu_info = lambda: info
  try:
    yield
  finally:
    pallas_call_registration.gpu_info_lib.get_gpu_info = original_info


def capture_triton_ir(function, *args) -> list[str]:
  """Triton IR text of every Pallas-Triton kernel in `function`, lowered for a faked H100."""
  import jax
  from jax._src.pallas.triton import pallas_call_registration

  captured = []
  original_lower = pallas_call_registration.lowering.lower_jaxpr_to_triton_module

  def spy(*a, **k):
    result = original_lower(*a, **k)
    captured.append(result.module.operation.get_asm(enable_debug_info=False))
    return result

  pallas_call_registration.lowering.lower_jaxpr_to_triton_module = spy
  try:
    with pallas_triton_for_h100():
      jax.jit(function).trace(*args).lower(lowering_platforms=("cuda",))
  finally:
    pallas_call_registration.lowering.lower_jaxpr_to_triton_module = original_lower
  return captured


def compile_sm90(ttir: str, *, num_warps: int, num_stages: int, workdir: str, name: str):
  """(sass, resource usage, ttgir) of Triton IR compiled for sm_90 by the `triton` package."""
  os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # what the 3.9 default does today
  import triton
  from triton.backends.compiler import GPUTarget

  path = os.path.join(workdir, f"{name}.ttir")
  with open(path, "w") as f:
    f.write(ttir)
  kernel = triton.compile(
    path,
    target=GPUTarget("cuda", 90, 32),
    options=dict(num_warps=num_warps, num_stages=num_stages),
  )
  cubin = os.path.join(workdir, f"{name}.cubin")
  with open(cubin, "wb") as f:
    f.write(kernel.asm["cubin"])
  sass, usage = disassemble(cubin)
  return sass, usage, kernel.asm["ttgir"]


def quantized_call_shapes(batch, heads, group, head_dim, tokens, bits, group_size):
  """Abstract (queries, k_codes, k_scale, k_min, v_codes, v_scale, v_min, lengths) of a
  quantized decode-attention call: KIVI's layout, bf16 statistics."""
  import jax
  import jax.numpy as jnp

  words = head_dim * bits // 32
  key_stats = (batch, heads, tokens // group_size, head_dim)
  value_stats = (batch, heads, tokens, head_dim // group_size)
  codes = (batch, heads, tokens, words)
  return tuple(
    jax.ShapeDtypeStruct(dims, dtype)
    for dims, dtype in (
      ((batch, heads, group, head_dim), jnp.bfloat16),
      (codes, jnp.uint32),
      (key_stats, jnp.bfloat16),
      (key_stats, jnp.bfloat16),
      (codes, jnp.uint32),
      (value_stats, jnp.bfloat16),
      (value_stats, jnp.bfloat16),
      ((batch,), jnp.int32),
    )
  )


def disassemble(cubin: str) -> tuple[str, str]:
  """(`cuobjdump -sass`, `cuobjdump -res-usage`) of a cubin, with the `triton` package's
  cuobjdump."""
  import triton

  tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
  cuobjdump = os.path.join(tools, "cuobjdump")
  sass = subprocess.run([cuobjdump, "-sass", cubin], capture_output=True, text=True, check=True)
  usage = subprocess.run(
    [cuobjdump, "-res-usage", cubin], capture_output=True, text=True, check=True
  )
  return sass.stdout, usage.stdout


def live_registers_listing(cubin: str) -> str:
  """`nvdisasm -lrm count` of a cubin (the `triton` package's nvdisasm): each instruction with the
  number of registers live across it."""
  import triton

  tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
  listing = subprocess.run(
    [os.path.join(tools, "nvdisasm"), "-lrm", "count", "-c", cubin],
    capture_output=True,
    text=True,
    check=True,
  )
  return listing.stdout


_LIVE_LINE = re.compile(r"/\*([0-9a-f]+)\*/\s+(.*?)\s*;\s*//\s*\|\s*(\d+)\s*\|")


def live_register_peak(listing: str) -> tuple[int, str]:
  """(the most general registers live across any instruction, "address: instruction" of the
  first that has them) from `live_registers_listing`. ptxas allocates at least this many, and
  rounds up (operand alignment of the wide instructions): the allocated count alone does not say
  how far a kernel is from a smaller allocation."""
  peak, where = -1, ""
  for line in listing.splitlines():
    match = _LIVE_LINE.search(line)
    if match and int(match.group(3)) > peak:
      peak, where = int(match.group(3)), f"{match.group(1)}: {match.group(2)}"
  if peak < 0:
    raise ValueError("no instruction with a live-register count in the listing")
  return peak, where


def kernel_cases(args):
  """(name, function, shapes, warps, stages, tokens per loop iteration) to analyse."""
  import jax
  import jax.numpy as jnp

  from kvjax.gear_cache import Gear
  from kvjax.quantization.outliers import outlier_count_per_side
  from pallas_kernels import decode_attention_triton as full_kernel
  from pallas_kernels import quantized_decode_attention_triton as quantized_kernel

  shape = jax.ShapeDtypeStruct
  batch, heads, group, head_dim, tokens = 8, 8, args.query_group, args.head_dim, args.tokens
  cases = []
  if args.bf16:
    cache = shape((batch, heads, tokens, head_dim), jnp.bfloat16)
    block = 32

    def full(q, k, v, lengths):
      return full_kernel.decode_attention_partials_triton(
        q, k, v, lengths, sm_scale=0.088, block_tokens=block, num_warps=4, num_stages=2
      )

    queries = shape((batch, heads, group, head_dim), jnp.bfloat16)
    lengths = shape((batch,), jnp.int32)
    cases.append(("bf16", full, (queries, cache, cache, lengths), 4, 2, block))
  # GEAR: the `gear` method's defaults (group 64, block 64, rank 2), outliers as asked.
  defaults = Gear(outliers=args.gear_outliers)
  for bits, gear in itertools.product(args.bits, (False, True) if args.gear else (False,)):
    group_size = args.group_size or (defaults.group_size if gear else 32)
    quantized = quantized_call_shapes(batch, heads, group, head_dim, tokens, bits, group_size)
    gear_arrays = {}
    if gear:
      blocks, rank = tokens // defaults.block, defaults.rank
      count = 2 * outlier_count_per_side(defaults.outliers, defaults.block * head_dim)
      a, b = (
        shape((batch, heads, tokens, rank), jnp.bfloat16),
        shape((batch, heads, blocks, head_dim, rank), jnp.bfloat16),
      )
      index, value = (
        shape((batch, heads, blocks, count), jnp.int32),
        shape((batch, heads, blocks, count), jnp.bfloat16),
      )
      gear_arrays = dict(lowrank=(a, b, a, b))
      if count:
        gear_arrays["outliers"] = (index, value, index, value)
    for variant in args.variants:
      overrides = dict(item.split("=", 1) for item in args.config)
      config = json.loads(overrides.get(variant, "{}"))
      config.setdefault("num_warps", 4)
      config.setdefault("num_stages", 3 if variant in ("reshape", "joined") else 2)
      if variant == "planar":
        config.setdefault("unroll", 2)
        step = group_size * config["unroll"]
      elif gear and config.get("gear_terms") != "xla":
        config.pop("block_tokens", None)  # one GEAR block per step
        step = defaults.block
      else:
        config.setdefault("block_tokens", 64 if variant == "joined" else 128)
        step = config["block_tokens"]

      def quantized_call(*a, bits=bits, variant=variant, config=config, group_size=group_size):
        *segment, lengths, extra = a
        return quantized_kernel.quantized_decode_attention_partials_triton(
          *segment,
          lengths,
          bits=bits,
          group_size=group_size,
          sm_scale=0.088,
          variant=variant,
          num_splits=32,
          block=defaults.block,
          **extra,
          **config,
        )

      method = f"gear{bits}" if gear else f"kivi{bits}"
      label = f"{method} {variant} " + ",".join(f"{k}={v}" for k, v in sorted(config.items()))
      cases.append(
        (
          label,
          quantized_call,
          quantized + (gear_arrays,),
          config["num_warps"],
          config["num_stages"],
          step,
        )
      )
  return cases


def split_merge_cost(value_order: str, *, tokens: int, workdir: str) -> dict:
  """Static cost of the split-merge kernel (`split_merge_triton`, no loop: the whole kernel) at
  the shape of record, 32 splits: instructions by opcode, registers, global loads by width."""
  import jax
  import jax.numpy as jnp

  from pallas_kernels import split_merge_triton
  from pallas_kernels.splits import gpu_target_programs, plan_splits

  batch, heads, group, head_dim, rows = 8, 8, 4, 128, 8
  splits = plan_splits(tokens, 64, batch * heads, None, gpu_target_programs()).num_splits
  arguments = (
    jax.ShapeDtypeStruct((batch, heads, splits, head_dim, rows), jnp.float32),
    jax.ShapeDtypeStruct((batch, heads, splits, rows), jnp.float32),
  )
  [ttir] = capture_triton_ir(
    lambda out, lse: split_merge_triton.merge_value_slot_partials_triton(
      out, lse, group=group, group_size=32, real_rows=4, value_order=value_order, bits=2
    ),
    *arguments,
  )
  sass, usage, _ = compile_sm90(
    ttir, num_warps=split_merge_triton.NUM_WARPS, num_stages=1, workdir=workdir, name="merge"
  )
  instructions = parse_sass(sass)
  opcodes = collections.Counter(opcode for _, opcode, _ in instructions)
  registers = re.search(r"REG:(\d+)", usage)
  return {
    "name": f"split merge, {splits} splits, value_order={value_order}",
    "instructions": len(instructions),
    "registers": int(registers.group(1)) if registers else -1,
    "global_loads": {op: n for op, n in sorted(opcodes.items()) if op.startswith("LDG")},
    "opcodes": dict(opcodes.most_common()),
  }


def main():
  from kvjax.gear_cache import Gear

  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument(
    "--variants",
    nargs="+",
    default=["reshape", "joined", "folded", "planar"],
    choices=["reshape", "joined", "folded", "planar"],
  )
  parser.add_argument("--bits", nargs="+", type=int, default=[2], choices=[2, 4, 8])
  parser.add_argument("--bf16", action="store_true", help="also the full-precision kernel")
  parser.add_argument(
    "--gear", action="store_true", help="also GEAR segments (the `gear` method's defaults)"
  )
  parser.add_argument(
    "--gear-outliers",
    type=float,
    default=Gear().outliers,
    help="GEAR's outlier fraction (0: GEAR-L, low rank only)",
  )
  parser.add_argument("--tokens", type=int, default=32768, help="context of the floors")
  parser.add_argument(
    "--query-group", type=int, default=4, help="query heads per KV head (the shape of record: 4)"
  )
  parser.add_argument(
    "--head-dim", type=int, default=128, choices=[64, 128], help="channels per head (128)"
  )
  parser.add_argument(
    "--group-size",
    type=int,
    help="quantization group of the codes (default 32 for KIVI, the `gear` method's for GEAR)",
  )
  parser.add_argument(
    "--config",
    action="append",
    default=[],
    help="VARIANT=JSON kernel settings, repeatable, e.g. 'joined={\"block_tokens\": 128}'",
  )
  parser.add_argument(
    "--split-merge",
    action="store_true",
    help="the split-merge kernel instead (split_merge_triton; channel, word and matrix orders)",
  )
  parser.add_argument("--out", help="write the records as JSON here")
  args = parser.parse_args()
  try:
    import triton  # noqa: F401
  except ImportError:
    sys.exit('this script needs triton: pip install -e ".[kernel-analysis]" (no GPU is needed)')

  if args.split_merge:
    with tempfile.TemporaryDirectory() as workdir:
      records = [
        split_merge_cost(order, tokens=args.tokens, workdir=workdir)
        for order in ("channel", "word", "matrix")
      ]
    for record in records:
      print(
        f"{record['name']}: {record['instructions']} instructions, {record['registers']} "
        f"registers, global loads {record['global_loads']}"
      )
    if args.out:
      with open(args.out, "w") as f:
        json.dump(records, f, indent=1)
    return

  records = []
  head_dim, programs_tokens = args.head_dim, 8 * 8 * args.tokens
  print(
    "| kernel | regs | instr/iter/warp | tokens/iter | thread instr/elem | smem wavefronts/iter"
    " | barriers/iter | layout conv. | issue floor us | smem floor us |"
  )
  print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
  with tempfile.TemporaryDirectory() as workdir:
    for index, (name, function, shapes, warps, stages, step) in enumerate(kernel_cases(args)):
      [ttir] = capture_triton_ir(function, *shapes)
      sass, usage, ttgir = compile_sm90(
        ttir, num_warps=warps, num_stages=stages, workdir=workdir, name=f"kernel{index}"
      )
      cost = loop_cost(name, sass, usage, ttgir, tokens_per_iteration=step, warps=warps)
      floors = cost.floors_us(programs_tokens=programs_tokens)
      print(
        f"| {name} | {cost.registers} | {cost.instructions} | {step} | "
        f"{cost.per_element(head_dim):.1f} | {cost.wavefronts:g} | {cost.barriers} | "
        f"{cost.layout_conversions} | {floors['issue_us']:.0f} | {floors['shared_us']:.0f} |",
        flush=True,
      )
      records.append({**asdict(cost), **floors, "per_element": cost.per_element(head_dim)})
  if args.out:
    with open(args.out, "w") as f:
      json.dump(records, f, indent=1)


if __name__ == "__main__":
  main()
