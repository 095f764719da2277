"""Static cost of the Mosaic GPU decode kernels (quantized; full-precision with --bf16), no GPU.

Compiles a kernel the way the GPU machine does, through jax's CUDA plugin, but for a compile-only
H100 (XLA's deviceless compilation: a PJRT topology built from a target description instead of
an attached device). Mosaic GPU's own pipeline turns the kernel into PTX there and dumps it;
ptxas compiles that PTX for sm_90a, and the SASS of the main loop is read off as in
`triton_static_cost.py` (same `loop_cost`): warp instructions per loop iteration by opcode,
barriers, registers, shared memory, the programs an SM can hold with those (CUDA's occupancy
rules), each warpgroup MMA's shadow (the instructions issued between the MMA and the wait for
it, which overlap the tensor core), and the issue floor at the benchmark shape. "live regs" is
the most registers live across any one instruction of the kernel (`nvdisasm -lrm count`, from
the `triton` package): ptxas allocates that many or a few more, so it says how far a kernel is
from an allocation that fits more programs per SM (96 registers for five at 128 threads).

With `warpgroups_per_program` K in a config (the folded kernel's, KERNEL_NOTES v42) the loop
counted is one warpgroup's (each runs a copy of the code of its own), "shared KB" is the whole
program's, and "warpgroups/SM" counts the SM's warpgroups: programs of K x 128 threads times K
(at K = 1 the programs per SM). Such a config takes ~90 s here at K = 5, against ~7 s to build
without this tool: with MOSAIC_GPU_DUMP_TO set, Mosaic GPU's layout inference also writes out its
constraint system, whose printing grows faster than the code.

What it is good for: comparing Mosaic kernels and their settings between GPU sessions. Against
Nsight Compute on an H100 (KERNEL_NOTES v13), the dequantizing kernel's loop counts 2771
instructions here and 2685 executed there, and the same 254-255 registers.

Setup, in its own environment (the CUDA plugin must not sit in the test environment: on a
machine without a GPU every jax import would try, and fail, to start CUDA):

  python3 -m venv .venv-mosaic-analysis
  .venv-mosaic-analysis/bin/pip install -e ".[dev,kernel-analysis]"
  .venv-mosaic-analysis/bin/pip install --no-deps "jax-cuda13-plugin==$(
    .venv-mosaic-analysis/bin/python -c 'import jax; print(jax.__version__)')" \
    "jax-cuda13-pjrt==$(.venv-mosaic-analysis/bin/python -c 'import jax; print(jax.__version__)')"

and, to compile with the GPU image's jax 0.11.2 (its Mosaic GPU lowering differs from 0.12's):

  python3 -m venv .venv-mosaic-analysis-0112
  .venv-mosaic-analysis-0112/bin/pip install -e ".[dev,kernel-analysis]" jax==0.11.2 jaxlib==0.11.2
  .venv-mosaic-analysis-0112/bin/pip install --no-deps jax-cuda13-plugin==0.11.2 \
    jax-cuda13-pjrt==0.11.2

plus a CUDA >= 13 `ptxas` on PATH or under $MOSAIC_GPU_CUDA_ROOT/bin, with libdevice under
$MOSAIC_GPU_CUDA_ROOT/nvvm/libdevice (default root /usr/local/cuda). cuobjdump is taken from the
`triton` package (the kernel-analysis extra). No GPU and no CUDA driver are needed. Example:

  PYTHONPATH=. .venv-mosaic-analysis/bin/python benchmarks/mosaic_static_cost.py \
    --variants dequantize folded --bits 2 4 --bf16

(`--bf16` adds the full-precision kernel. Its loop count includes the branch that zeroes the
values past a row's length, which runs only in a split's last block.)

The loop count includes the instructions only the first warp runs (the folded kernel's copies
with `copy_issuer="first_warp"`); the "first warp only" column counts them. Each warp's own path
through the body (`triton_static_cost.warp_path_lengths`: the branches on the warp index taken as
that warp takes them) gives the "slowest warp" column, what the block's barriers wait for, and
the mean the issue floor and instructions per element use.

`--min-programs-per-sm N` puts `.minnctapersm N` in the kernel's PTX instead of Mosaic GPU's
`.minnctapersm 1` before ptxas compiles it: what ptxas does when told to fit N programs per SM
(for 128 threads and N = 4, at most 128 registers), which Mosaic GPU offers no way to ask for
(KERNEL_NOTES v37). A measurement of what such a request would give, not of what the kernel
compiles to on a GPU.
"""

import argparse
import functools
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

# The plugin refuses to start without cuDNN and the other CUDA libraries a device run needs;
# compiling needs none of them. Read when jax loads its plugins, so set before jax is imported.
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
DUMP_DIRECTORY = tempfile.mkdtemp(prefix="mosaic_static_cost_")
os.environ["MOSAIC_GPU_DUMP_TO"] = DUMP_DIRECTORY
os.environ["MOSAIC_GPU_DUMP_PTX"] = "1"
os.environ["MOSAIC_GPU_DUMP_PTXAS"] = "1"

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import triton_static_cost  # noqa: E402  (needs the environment above first)
from sm90_occupancy import THREADS_PER_WARPGROUP, programs_per_sm  # noqa: E402

# What XLA needs to know of the device to compile for it (GpuTargetConfigProto, text format):
# an H100 SXM's published limits.
H100_TARGET_CONFIG = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 84942979072
  shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 feature_extension: ACCELERATED_FEATURES }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  thread_dim_limit_x: 1024
  thread_dim_limit_y: 1024
  thread_dim_limit_z: 64
  device_vendor: "NVIDIA Corporation"
  platform_version: "Compute Capability 9.0a"
  name: "NVIDIA H100 80GB HBM3"
}
platform_name: "CUDA"
device_description_str: "NVIDIA H100 80GB HBM3"
"""

BENCHMARK_SHAPE = dict(batch=8, kv_heads=8, group=4, head_dim=128, tokens=32768, group_size=32)


def compile_only_device():
  """A jax device standing for one H100 that can be compiled for but not run on."""
  from jax._src import xla_bridge

  topology = xla_bridge.make_pjrt_topology(
    "cuda", "", topology="1x1x1", target_config=H100_TARGET_CONFIG
  )
  return topology._make_compile_only_devices()[0]


def kernel_call(
  variant: str,
  bits: int,
  settings: dict,
  group: int = BENCHMARK_SHAPE["group"],
  head_dim: int = BENCHMARK_SHAPE["head_dim"],
):
  """(function, abstract arguments) of one quantized Mosaic GPU kernel at the benchmark shape,
  with `group` query heads per KV head and `head_dim` channels."""
  from pallas_kernels import quantized_decode_attention_gpu

  shape = dict(BENCHMARK_SHAPE, group=group, head_dim=head_dim)
  module, entry_point = quantized_decode_attention_gpu.MOSAIC_GPU_KERNELS[variant]
  call = functools.partial(
    getattr(module, entry_point),
    bits=bits,
    group_size=shape["group_size"],
    sm_scale=shape["head_dim"] ** -0.5,
    **settings,
  )
  arguments = triton_static_cost.quantized_call_shapes(
    shape["batch"],
    shape["kv_heads"],
    shape["group"],
    shape["head_dim"],
    shape["tokens"],
    bits,
    shape["group_size"],
  )
  return call, arguments


def full_precision_call(settings: dict):
  """(function, abstract arguments) of the full-precision (bf16) Mosaic GPU kernel at the
  benchmark shape."""
  import jax
  import jax.numpy as jnp

  from pallas_kernels import decode_attention_mosaic_gpu

  shape = BENCHMARK_SHAPE
  call = functools.partial(
    decode_attention_mosaic_gpu.decode_attention_partials_mosaic_gpu,
    sm_scale=shape["head_dim"] ** -0.5,
    **settings,
  )
  batch, heads, group = shape["batch"], shape["kv_heads"], shape["group"]
  cache = jax.ShapeDtypeStruct((batch, heads, shape["tokens"], shape["head_dim"]), jnp.bfloat16)
  queries = jax.ShapeDtypeStruct((batch, heads, group, shape["head_dim"]), jnp.bfloat16)
  lengths = jax.ShapeDtypeStruct((batch,), jnp.int32)
  return call, (queries, cache, cache, lengths)


def ptx_of(function, arguments, device) -> tuple[str, str]:
  """(PTX, Mosaic's resource summary) of the one Mosaic GPU kernel in `function`."""
  import jax

  for stale in glob.glob(os.path.join(DUMP_DIRECTORY, "*")):
    os.remove(stale)
  sharding = jax.sharding.SingleDeviceSharding(device)
  placed = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in arguments]
  jax.jit(function).trace(*placed).lower(lowering_platforms=("cuda",)).compile()
  ptx = glob.glob(os.path.join(DUMP_DIRECTORY, "*.ptx"))
  if len(ptx) != 1:
    raise RuntimeError(f"expected one Mosaic GPU kernel's PTX in {DUMP_DIRECTORY}, found {ptx}")
  resources = glob.glob(os.path.join(DUMP_DIRECTORY, "*.resources.txt"))
  with open(ptx[0]) as f:
    text = f.read()
  summary = ""
  if resources:
    with open(resources[0]) as f:
      summary = f.read()
  return text, summary


def tool(name: str) -> str:
  root = os.environ.get("MOSAIC_GPU_CUDA_ROOT", "/usr/local/cuda")
  for candidate in (os.path.join(root, "bin", name), shutil.which(name)):
    if candidate and os.path.exists(candidate):
      return candidate
  raise FileNotFoundError(f"{name} not found under {root}/bin or on PATH (CUDA >= 13 needed)")


def with_min_programs_per_sm(ptx: str, programs: int) -> str:
  """The PTX with its kernel's `.minnctapersm` directive set to `programs`; ValueError if it has
  none (Mosaic GPU's kernels carry one)."""
  edited, count = re.subn(r"^\.minnctapersm \d+$", f".minnctapersm {programs}", ptx, flags=re.M)
  if count != 1:
    raise ValueError(f"expected one .minnctapersm directive in the PTX, found {count}")
  return edited


def sass_of(ptx: str, workdir: str, name: str) -> tuple[str, str, tuple[int, str]]:
  """(SASS listing, cuobjdump resource usage, (peak live registers, where)) of PTX compiled for
  sm_90a."""
  source = os.path.join(workdir, f"{name}.ptx")
  cubin = os.path.join(workdir, f"{name}.cubin")
  with open(source, "w") as f:
    f.write(ptx)
  subprocess.run([tool("ptxas"), "-arch=sm_90a", "-O3", source, "-o", cubin], check=True)
  sass, usage = triton_static_cost.disassemble(cubin)
  live = triton_static_cost.live_register_peak(triton_static_cost.live_registers_listing(cubin))
  return sass, usage, live


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument(
    "--variants",
    nargs="+",
    default=["dequantize", "folded"],
    choices=["dequantize", "folded", "warp"],
  )
  parser.add_argument("--bits", nargs="+", type=int, default=[2], choices=[2, 4])
  parser.add_argument(
    "--bf16",
    action="store_true",
    help="also the full-precision kernel (decode_attention_mosaic_gpu, its default settings)",
  )
  parser.add_argument(
    "--configs",
    default="[{}]",
    help='JSON list of kernel settings, e.g. \'[{}, {"block_tokens": 64, "num_stages": 4}]\'',
  )
  parser.add_argument(
    "--min-programs-per-sm",
    type=int,
    help="compile each kernel's PTX with .minnctapersm set to this (see the module doc)",
  )
  parser.add_argument(
    "--query-group",
    type=int,
    default=BENCHMARK_SHAPE["group"],
    help="query heads per KV head of the quantized kernels' calls (the benchmark's: 4)",
  )
  parser.add_argument(
    "--head-dim",
    type=int,
    default=BENCHMARK_SHAPE["head_dim"],
    choices=[64, 128],
    help="channels per head of the quantized kernels' calls (the benchmark's: 128)",
  )
  parser.add_argument("--out", help="write the rows as JSON here")
  args = parser.parse_args()

  device = compile_only_device()
  shape = dict(BENCHMARK_SHAPE, head_dim=args.head_dim)
  programs_tokens = shape["batch"] * shape["kv_heads"] * shape["tokens"]
  # (label, file name, (function, arguments), tokens per iteration, branch arms, warpgroups per
  # program, settings): with arms (0, 1), a row per path through the loop body's branch
  # (`triton_static_cost.branch_paths`).
  cases = []
  if args.bf16:
    settings = {"block_tokens": 64, "num_stages": 2}  # the kernel's defaults
    cases.append(
      (
        "bf16",
        "bf16",
        full_precision_call(settings),
        settings["block_tokens"],
        (None,),
        1,
        settings,
      )
    )
  for variant in args.variants:
    for bits in args.bits:
      for settings in json.loads(args.configs):
        # the warp variant: 128-token blocks only, its own default of 4 stages
        stages = 4 if variant == "warp" else 2
        settings = {"block_tokens": 128, "num_stages": stages, **settings}
        label = f"kivi{bits} {variant} " + ",".join(
          f"{key}={value}" for key, value in sorted(settings.items())
        )
        if args.query_group != BENCHMARK_SHAPE["group"]:
          label += f" [query group {args.query_group}]"
        if args.head_dim != BENCHMARK_SHAPE["head_dim"]:
          label += f" [head_dim {args.head_dim}]"
        call = kernel_call(variant, bits, settings, args.query_group, args.head_dim)
        # row_max="bound": each block takes the fixed reference's arm or the exchange's
        arms = (0, 1) if settings.get("row_max") == "bound" else (None,)
        if variant == "warp":  # a loop per softmax path: the fixed one has no FMNMX
          arms = ("fixed loop", "exact loop")
        # a loop iteration computes one ring slot: blocks_per_copy blocks (the folded kernel's)
        tokens = settings["block_tokens"] * settings.get("blocks_per_copy", 1)
        warpgroups = settings.get("warpgroups_per_program", 1)
        cases.append((label, f"{variant}{bits}", call, tokens, arms, warpgroups, settings))
  rows = []
  with tempfile.TemporaryDirectory() as workdir:
    for label, file_name, call, tokens_per_iteration, arms, warpgroups, settings in cases:
      ptx, resources = ptx_of(*call, device)
      if args.min_programs_per_sm:
        ptx = with_min_programs_per_sm(ptx, args.min_programs_per_sm)
        label += f" [.minnctapersm {args.min_programs_per_sm}]"
      sass, usage, (live_registers, live_peak_at) = sass_of(ptx, workdir, file_name)
      paths = [None]
      if arms == (0, 1):  # the arm with the row max's FMNMX is the exchange's
        paths = triton_static_cost.branch_paths(
          triton_static_cost.main_loop(triton_static_cost.parse_sass(sass))
        )
      for arm in arms:
        loop_without = "FMNMX" if arm == "fixed loop" else None
        cost = triton_static_cost.loop_cost(
          label,
          sass,
          usage,
          "",
          tokens_per_iteration=tokens_per_iteration,
          warps=THREADS_PER_WARPGROUP // 32,  # each warpgroup's own code (`_warpgroup_program`)
          branch_arm=arm if arms == (0, 1) else None,
          loop_without=loop_without,
        )
        if isinstance(arm, str):
          cost.name += f" [{arm}]"
          paths = [triton_static_cost.main_loop(triton_static_cost.parse_sass(sass), loop_without)]
        elif arm is not None:
          row_max = any(opcode.startswith("FMNMX") for _, opcode, _ in paths[arm])
          cost.name += " [exchange arm]" if row_max else " [fixed arm]"
        try:
          path = paths[0] if isinstance(arm, str) else paths[arm or 0]
          if settings.get("copy_issuer") == "slot_owner":  # the warp variant's
            cost.warp_instructions = triton_static_cost.slot_owner_warp_lengths(
              sass, path, warps=cost.warps, stages=settings["num_stages"]
            )
          else:
            cost.warp_instructions = triton_static_cost.warp_path_lengths(
              sass, path, warps=cost.warps
            )
        except ValueError as unknown:  # the mean then counts every warp's branches (an upper bound)
          print(f"{cost.name}: no per-warp count ({unknown})", file=sys.stderr)
        shared = re.search(r"smem_scratch_bytes=(\d+)", resources)
        cost.shared_bytes = int(shared.group(1)) if shared else -1
        # the whole kernel's (prologue and epilogue included), not the arm's
        cost.live_registers, cost.live_peak_at = live_registers, live_peak_at
        floors = cost.floors_us(programs_tokens=programs_tokens)
        floors["programs_per_sm"] = programs_per_sm(cost.registers, cost.shared_bytes, warpgroups)
        floors["warpgroups_per_sm"] = floors["programs_per_sm"] * warpgroups
        rows.append((cost, floors))

  print(
    "| kernel | regs | live regs | shared KB | warpgroups/SM | instr/iter/warp | first warp only "
    "| slowest warp | tokens/iter | thread instr/elem | barriers/iter | wgmma shadows "
    "| issue floor us |"
  )
  print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
  for cost, floors in rows:
    print(
      f"| {cost.name} | {cost.registers} | {cost.live_registers} | {cost.shared_bytes / 1024:.0f} "
      f"| {floors['warpgroups_per_sm']} | {cost.instructions} | {cost.first_warp_only} "
      f"| {max(cost.warp_instructions) if cost.warp_instructions else '?'} "
      f"| {cost.tokens_per_iteration} | {cost.per_element(shape['head_dim']):.1f} "
      f"| {cost.barriers} | {' / '.join(map(str, cost.wgmma_shadows))} "
      f"| {floors['issue_us']:.0f} |"
    )
  for cost, _ in rows:
    print(f"{cost.name}: {cost.opcodes}")
    print(f"  live registers peak at {cost.live_peak_at}")
  if args.out:
    with open(args.out, "w") as f:
      json.dump([{**vars(cost), **floors} for cost, floors in rows], f, indent=1, default=str)


if __name__ == "__main__":
  try:
    main()
  finally:
    shutil.rmtree(DUMP_DIRECTORY, ignore_errors=True)
