"""Static cycle counts of the TPU kernels, from the VLIW bundles libtpu schedules for them,
compiled for a TPU that is not there (`tpu_compile_check`).

A TensorCore issues one VLIW bundle a cycle, scheduled by the compiler: a kernel's grid runs as
one loop whose body (the bundles from the loop header to its back edge) is what each grid step
issues, stalls aside (a DMA not yet landed, which is where an HBM-bound kernel waits). libtpu
writes the final bundles of every program it compiles, Mosaic kernels included, when asked
(`--xla_jf_dump_to` with `--xla_jf_dump_llo_text`, in `LIBTPU_INIT_ARGS`, read once when libtpu
loads: this script sets it before anything loads libtpu). From them, per kernel:

  loop bundles   the grid loop's body, every predicated region counted (the block's compute
                 is skipped past a row's length; the first and last steps' init and write run
                 at some steps only): the cycles of a step that attends, a little over;
  unit ops       the ops the body issues per unit (VALU slots, MXU, XLU, loads, stores, ...:
                 libtpu's per-bundle utilization, capacities per bundle beside);
  static cycles  grid steps x loop bundles, for a call at full length;
  HBM cycles     the bytes the kernel reads from HBM (its cache arrays) over the chip's HBM
                 bandwidth, in the same cycles.

A kernel whose static cycles exceed its HBM cycles issues longer than its reads take: it is
bound by its instructions, not by memory, whatever a TPU's DMAs do. Cycles become time only
with a clock: for a v5e, 197 bf16 TFLOP/s from four 128 x 128 MXUs (Cloud TPU's v5e page)
give 1.50 GHz, and its HBM reads 819 GB/s (the same page): 546 bytes a cycle. Other
generations are reported in cycles only. None of this is a time measured on a TPU.

  PYTHONPATH=. .venv/bin/python benchmarks/tpu_static_cost.py [--topology v5e:2x2]
    [--head-dim 128] [--tokens 32768] [--block-tokens 512 1024 2048] [--out FILE.json]
"""

import argparse
import dataclasses
import json
import math
import os
import re
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax.numpy as jnp  # noqa: E402
import tpu_compile_check  # noqa: E402

V5E_CLOCK_HZ = 197e12 / (4 * 128 * 128 * 2)  # bf16 peak over four 128 x 128 MXUs: 1.50 GHz
V5E_HBM_BYTES_PER_SECOND = 819e9
# A bundle line: its address (0, 0x1, ...), a control-flow mark (LB: loop body start, PF:
# predicated region fallthrough, ...), then "{ ops }".
_BUNDLE = re.compile(r"^\s*(0x[0-9a-f]+|0)\s+([A-Z]{2})?\s*:\s*>?\s*\{(.*)$")


def dump_bundles_to(directory: str) -> None:
  """Have libtpu write every program's final bundles into `directory`. Its flags are read once,
  when libtpu loads (the first TPU topology built in the process): call this before that."""
  os.environ["LIBTPU_INIT_ARGS"] = " ".join(
    [
      os.environ.get("LIBTPU_INIT_ARGS", ""),
      f"--xla_jf_dump_to={directory}",
      "--xla_jf_dump_llo_text=true",
    ]
  ).strip()


@dataclasses.dataclass(frozen=True)
class BundleCounts:
  total_bundles: int
  loop_bundles: int  # 0 where the program has no loop (a grid of one step)
  loop_unit_ops: dict[str, int]  # per unit, the ops the loop body issues
  unit_capacity: dict[str, int]  # per unit, how many a bundle can hold


def read_bundles(final_bundles: str, utilization: str) -> BundleCounts:
  """The counts of one program from libtpu's dumps: its final bundles' text and its static
  per-bundle utilization (one row of per-unit op counts per bundle, in address order)."""
  addresses, loop_start, back_edge = [], None, None
  for line in final_bundles.splitlines():
    match = _BUNDLE.match(line)
    if match is None:
      continue
    address = int(match.group(1), 16)
    addresses.append(address)
    if match.group(2) == "LB" and loop_start is None:
      loop_start = address
    if "sbr.rel" in match.group(3) and loop_start is not None:
      back_edge = address  # the last branch after the loop's start: its back edge
  lines = utilization.splitlines()
  # libtpu spells the header "CAPACTIY".
  header = next(index for index, line in enumerate(lines) if line.startswith("== CAPAC"))
  units = lines[header + 1].replace(",", " ").split()
  capacity = dict(zip(units, (int(value) for value in lines[header + 2].split()), strict=True))
  rows = [
    [int(value) for value in line.split()]
    for line in lines[lines.index("== UTILIZATION:") + 1 :]
    if line.strip()
  ]
  if len(rows) != len(addresses):
    raise ValueError(f"{len(rows)} utilization rows for {len(addresses)} bundles")
  if loop_start is None or back_edge is None:
    body = range(0)
  else:
    body = range(loop_start, back_edge + 1)
  ops = {unit: sum(rows[address][index] for address in body) for index, unit in enumerate(units)}
  return BundleCounts(len(addresses), len(body), ops, capacity)


def xla_estimated_cycles(compiled) -> int:
  """The cycles XLA's cost model estimates for the ops of a compiled program that it records
  them for (`estimated_cycles` in their backend configs: its fusions, copies and the like, not
  a Mosaic kernel), summed over the program once: for a call without loops, what runs around
  the kernel. An estimate of XLA's, not a count of bundles."""
  return sum(int(cycles) for cycles in re.findall(r'estimated_cycles":"(\d+)"', compiled.as_text()))


def kernel_bundles(
  function, shapes, topology: str, kernel_name: str, dumps: str
) -> tuple[BundleCounts, int]:
  """Compile `function` on `shapes` for `topology` and read the bundles of the Mosaic kernel
  named `kernel_name` (the `pallas_call`'s name) from the dumps this compile wrote into
  `dumps` (`dump_bundles_to`); with XLA's estimated cycles of the rest of the program."""
  before = set(os.listdir(dumps))
  compiled = tpu_compile_check.compile_for_tpu(function, shapes, topology)
  written = sorted(set(os.listdir(dumps)) - before)

  def one(suffix: str) -> str:
    found = [name for name in written if f"-{kernel_name}." in name and name.endswith(suffix)]
    if len(found) != 1:
      raise ValueError(f"expected one {suffix} dump of {kernel_name}, found {found}")
    with open(os.path.join(dumps, found[0])) as handle:
      return handle.read()

  counts = read_bundles(
    one("-final_bundles.txt"), one("-final_hlo-static-per-bundle-utilization.txt")
  )
  return counts, xla_estimated_cycles(compiled)


def gear_outlier_count(head_dim: int) -> int:
  """The outliers a 64-token GEAR block holds at GEAR's default 2% (both sides together)."""
  return round(0.02 * 64 * head_dim)


def gear_shapes(head_dim: int, tokens: int, bits: int):
  """(shape, dtype[, major_to_minor]) arguments of a GEAR decode call at the shapes of record
  with GEAR's defaults (`kvjax.gear_cache.Gear`): quantization groups and blocks of 64 tokens,
  rank 2, 2% outliers a block and side (82 at head_dim 64, 164 at 128) stored as a TPU cache
  stores them, in whole lane tiles (128 and 256 slots: `stored_outlier_slots`, since v65),
  uint16 indices."""
  from pallas_kernels.gear_outlier_terms_tpu import OUTLIER_LAYOUT, stored_outlier_slots

  batch, kv_heads, group, block, rank = 8, 8, 4, 64, 2
  outliers = stored_outlier_slots(gear_outlier_count(head_dim))
  blocks = tokens // block
  codes = ((batch, kv_heads, tokens, head_dim * bits // 32), jnp.uint32)
  key_stats = ((batch, kv_heads, tokens // block, head_dim), jnp.bfloat16)
  value_stats = ((batch, kv_heads, tokens, head_dim // block), jnp.bfloat16)
  factors = (
    ((batch, kv_heads, tokens, rank), jnp.bfloat16),
    ((batch, kv_heads, blocks, head_dim, rank), jnp.bfloat16),
  ) * 2
  # The outliers in the row-major layout the cache pins inside a decode loop
  # (`gear_outlier_terms_tpu.OUTLIER_LAYOUT`). As arguments in a TPU's default layout for their
  # shape (the GEAR blocks minor: 164 outliers fill 2 lane tiles badly) XLA copied all four into
  # the kernel's layout at every call: 0.63 M of its estimated cycles a call at 32k (v58-v62).
  sparse = (
    ((batch, kv_heads, blocks, outliers), jnp.uint16, OUTLIER_LAYOUT),
    ((batch, kv_heads, blocks, outliers), jnp.bfloat16, OUTLIER_LAYOUT),
  ) * 2
  segment = (codes, key_stats, key_stats, codes, value_stats, value_stats)
  queries = ((batch, kv_heads, group, head_dim), jnp.bfloat16)
  return (queries, *segment, ((batch,), jnp.int32), *factors, *sparse)


def _bytes_of(shapes) -> int:
  return sum(math.prod(shape[0]) * jnp.dtype(shape[1]).itemsize for shape in shapes)


def static_cost(
  kernel: str,
  *,
  head_dim: int,
  tokens: int,
  block_tokens: int,
  topology: str,
  dumps: str,
  num_splits: int = 1,
) -> dict:
  """One kernel at the benchmark shape (batch 8, 8 KV heads x 4, bf16 statistics): "bf16"
  (`decode_attention_tpu`), "kivi2" / "kivi4" (`quantized_decode_attention_tpu`, group 32) or
  "gear2" / "gear4" (the same kernel with GEAR's low-rank and outlier terms, `gear_shapes`).
  XLA's work around a kernel is in `xla_estimated_cycles` (XLA's own cost model)."""
  from pallas_kernels import quantized_decode_attention_tpu
  from pallas_kernels.splits import plan_splits

  config = dict(block_tokens=block_tokens, num_splits=num_splits)
  if kernel == "bf16":
    function = tpu_compile_check.full_precision_call(**config)
    name, block = "decode_attention_tpu", block_tokens
    shapes = tpu_compile_check.record_shapes(head_dim, tokens, None)
    cache_shapes = shapes[1:3]
  elif kernel.startswith("kivi"):
    bits = int(kernel.removeprefix("kivi"))
    function = tpu_compile_check.quantized_call(bits, **config)
    name = f"quantized_decode_attention_{bits}bit_tpu"
    block = quantized_decode_attention_tpu.block_tokens_for(
      tokens, 32, jnp.bfloat16, block_tokens, head_dim
    )
    shapes = tpu_compile_check.record_shapes(head_dim, tokens, bits)
    cache_shapes = shapes[1:7]
  else:
    bits = int(kernel.removeprefix("gear"))
    # The real outliers, not the padding the kernel skips (`outlier_count`).
    function = tpu_compile_check.gear_call(
      bits, group_size=64, outlier_count=gear_outlier_count(head_dim), **config
    )
    name = f"quantized_decode_attention_{bits}bit_tpu"
    block = quantized_decode_attention_tpu.block_tokens_for(
      tokens,
      64,
      jnp.bfloat16,
      block_tokens,
      head_dim,
      gear_block=64,
      lowrank=True,
      outlier_itemsize=2,
    )
    shapes = gear_shapes(head_dim, tokens, bits)
    cache_shapes = shapes[1:7] + shapes[8:]  # the lengths (eighth) left out
  counts, xla_cycles = kernel_bundles(function, shapes, topology, name, dumps)
  batch, kv_heads = shapes[0][0][:2]
  plan = plan_splits(tokens, block, batch * kv_heads, num_splits, target_programs=1)
  steps = batch * kv_heads * plan.num_splits * plan.blocks_per_split
  cache_bytes = _bytes_of(cache_shapes)
  static_cycles = steps * counts.loop_bundles
  row = dict(
    kernel=kernel,
    head_dim=head_dim,
    tokens=tokens,
    block_tokens=block,
    topology=topology,
    grid_steps=steps,
    **dataclasses.asdict(counts),
    static_cycles=static_cycles,
    xla_estimated_cycles=xla_cycles,
    cache_bytes=cache_bytes,
  )
  if topology.startswith("v5e"):
    row["static_us_v5e"] = round(static_cycles / V5E_CLOCK_HZ * 1e6, 1)
    row["hbm_us_v5e"] = round(cache_bytes / V5E_HBM_BYTES_PER_SECOND * 1e6, 1)
  return row


def _rows(args, dumps: str) -> list[dict]:
  rows = []
  for head_dim in args.head_dim:
    for kernel in args.kernels:
      for block_tokens in args.block_tokens:
        row = static_cost(
          kernel,
          head_dim=head_dim,
          tokens=args.tokens,
          block_tokens=block_tokens,
          topology=args.topology,
          dumps=dumps,
        )
        key = lambda row: (row["kernel"], row["head_dim"], row["block_tokens"])
        if rows and key(rows[-1]) == key(row):
          continue  # rounded up to the last row's block (`block_tokens_for`)
        rows.append(row)
        timing = ""
        if "static_us_v5e" in row:
          timing = f", {row['static_us_v5e']} us static vs {row['hbm_us_v5e']} us of HBM (v5e)"
        print(
          f"{kernel:5} head_dim {head_dim:3} block {row['block_tokens']:5}: "
          f"{row['loop_bundles']} bundles a step x {row['grid_steps']} steps = "
          f"{row['static_cycles'] / 1e6:.2f} M cycles{timing}; VALU ops a step "
          f"{row['loop_unit_ops'].get('VALU')}"
        )
  return rows


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--topology", default="v5e:2x2", choices=tpu_compile_check.TOPOLOGIES)
  parser.add_argument("--head-dim", type=int, nargs="+", default=[128])
  parser.add_argument("--tokens", type=int, default=32768)
  parser.add_argument(
    "--kernels", nargs="+", default=["bf16", "kivi2", "kivi4"], help="also gear2, gear4"
  )
  parser.add_argument("--block-tokens", type=int, nargs="+", default=[512, 1024, 2048])
  parser.add_argument("--out", help="write the rows as JSON here")
  args = parser.parse_args(argv)
  with tempfile.TemporaryDirectory(prefix="tpu_static_cost_") as dumps:
    dump_bundles_to(dumps)
    rows = _rows(args, dumps)
  if args.out:
    with open(args.out, "w") as handle:
      json.dump(rows, handle, indent=1)


if __name__ == "__main__":
  main()
