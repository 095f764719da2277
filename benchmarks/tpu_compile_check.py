"""The TPU kernels compiled for a TPU without one: whether Mosaic compiles them, and what XLA
moves around each.

libtpu compiles for a TPU that is not attached: `jax.experimental.topologies` builds a PJRT
topology of a named TPU generation ("v5e:2x2", "v6e:2x2", "v4:2x2x1"), and a function jitted
on arguments placed on its device compiles as for that chip, Mosaic's own compiler included
(`compile_for_tpu`). Interpret mode never runs that compiler, and this is how the project
found (KERNEL_NOTES v49) that both TPU kernels failed there ("infer-vector-layout: unsupported
shape cast" on a 1-D token mask), and that the quantized kernel's [block, words] operands
made XLA copy every packed-code and value-statistics array into a layout padded to 128 lanes
at every call.

`large_copies` lists the instructions of the optimised program that copy or transpose an
array of at least `min_bytes` as laid out (the tiles of the layout XLA chose, padding
included): for a decode call at the benchmark shape, any such instruction is a relayout of
the cache, which the kernels are laid out to avoid.

Setup: `pip install -e ".[dev]"` (the dev extra brings libtpu, on Linux x86-64). No TPU is
needed. Example (the shapes of record, a TPU v5e):

  PYTHONPATH=. .venv/bin/python benchmarks/tpu_compile_check.py [--topology v6e:2x2]

and, with `--decode`, kvjax's own decode over KIVI-2 and GEAR-2 caches: the cache-sized arrays
it copies at every step and in the flush branch.
"""

import argparse
import contextlib
import dataclasses
import functools
import json
import math
import os
import re
import sys

# Nothing here runs on a device; with libtpu installed and no TPU attached, jax would otherwise
# try to start one (and log why it could not) before falling back to the CPU.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# libtpu's one-process lock would refuse a second compile-only process (a test worker beside).
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental.layout import Format, Layout  # noqa: E402

TOPOLOGIES = ("v5e:2x2", "v6e:2x2", "v4:2x2x1")
ELEMENT_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2}
COPY_OPCODES = ("copy", "transpose", "copy-start")
# An optimised-HLO result: dtype[dims]{minor_to_major:T(tile)...}, e.g.
# u32[8,8,32768,8]{3,2,1,0:T(8,128)} or bf16[8,8,1024,64]{2,3,1,0:T(8,128)(2,1)S(1)}.
_SHAPE = re.compile(r"(\w+)\[([\d,]*)\](?:\{([\d,]*)(?::T\((\d+),(\d+)\))?)?")
# name = shape opcode(operands...), attributes; a tuple shape (copy-start's, a loop's) holds
# spaces, and its elements' layouts hold ")" but never ") " followed by an opcode.
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?[\w.\-]+ = (\(.*?\)|\S+) ([\w\-]+)\(")
# The computations an instruction runs as control flow: a conditional's branches, a loop's body
# and condition, a call's callee (fusions' computations are one kernel, not walked).
_CALLED = re.compile(
  r"\b(?:branch_computations=\{([^}]*)\}|(?:true|false)_computation=%?([\w.\-]+)|"
  r"body=%?([\w.\-]+)|condition=%?([\w.\-]+)|to_apply=%?([\w.\-]+))"
)
_CONTROL_FLOW = ("conditional", "while", "call")


def libtpu_available() -> bool:
  """Whether a TPU topology can be built here (libtpu installed)."""
  try:
    tpu_device("v5e:2x2")
  except Exception:  # noqa: BLE001 - any failure to load libtpu means "not available"
    return False
  return True


@functools.cache
def tpu_device(topology: str):
  """The first device of a compile-only TPU topology."""
  from jax.experimental import topologies

  return topologies.get_topology_desc(platform="tpu", topology_name=topology).devices[0]


def shape_on(device, shape, dtype, major_to_minor=None) -> jax.ShapeDtypeStruct:
  """An argument on `device`; with `major_to_minor`, in that layout (else the device's default
  for the shape, which for a small last dimension may not be row-major)."""
  sharding = jax.sharding.SingleDeviceSharding(device)
  if major_to_minor is not None:
    sharding = Format(Layout(major_to_minor=tuple(major_to_minor)), sharding)
  return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def compile_for_tpu(function, shapes, topology: str = "v5e:2x2"):
  """`jax.jit(function)` compiled for `topology` on arguments of `shapes` ((shape, dtype)
  pairs, (shape, dtype, major_to_minor) triples, or pytrees of them as a tuple). The TPU
  kernels read the chip's generation from the default device while they lower, so it is set to
  the topology's for the compile."""
  device = tpu_device(topology)
  placed = jax.tree.map(
    lambda pair: shape_on(device, *pair),
    shapes,
    is_leaf=_is_shape_pair,
  )
  with _without_compilation_cache(), jax.default_device(device):
    return jax.jit(function).lower(*placed).compile()


@contextlib.contextmanager
def _without_compilation_cache():
  """A compile-only executable cannot be loaded back from the persistent compilation cache (the
  tests' conftest turns it on): compiles inside this leave it out of the cache."""
  cache_was_on = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)
  try:
    yield
  finally:
    jax.config.update("jax_enable_compilation_cache", cache_was_on)


def _is_shape_pair(node) -> bool:
  return (
    isinstance(node, tuple)
    and len(node) in (2, 3)
    and isinstance(node[0], tuple)
    and all(isinstance(size, int) for size in node[0])
  )


@dataclasses.dataclass(frozen=True)
class Instruction:
  opcode: str
  shape: str  # as the optimised HLO prints it, layout included
  bytes: int  # laid out: the two most minor dimensions padded to the layout's tile (a
  # copy-start's: its destination's, the first of its (destination, source, context) tuple)
  computation: str = ""  # where it is: the one asked for, or a branch, body or callee of it
  # Reached only through a conditional's branch (a compressed cache's flush: not every step);
  # the rest runs whenever the computation asked for does (nested loops: as often as they turn).
  in_branch: bool = False


def laid_out_bytes(shape: str) -> int:
  """Bytes of an array shape string with its layout's tiling (0 for a tuple or token)."""
  match = _SHAPE.match(shape)
  if match is None:
    return 0
  dtype, dims, minor_to_major, tile_rows, tile_lanes = match.groups()
  dims = [int(d) for d in dims.split(",") if d]
  if not dims:
    return ELEMENT_BYTES.get(dtype, 4)
  order = [int(d) for d in (minor_to_major or "").split(",") if d] or list(range(len(dims)))[::-1]
  physical = [dims[axis] for axis in reversed(order)]  # major to minor
  if tile_rows is not None:
    physical[-1] = -(-physical[-1] // int(tile_lanes)) * int(tile_lanes)
    if len(physical) > 1:
      physical[-2] = -(-physical[-2] // int(tile_rows)) * int(tile_rows)
  return math.prod(physical) * ELEMENT_BYTES.get(dtype, 4)


def _computation_body(text: str, computation: str | None) -> str:
  header = "\nENTRY" if computation is None else f"\n%{computation} "
  start = text.index(header)
  body = text[start:]
  return body[body.index("{\n") + 2 : body.index("\n}")]


def entry_instructions(
  compiled, computation: str | None = None, *, walk_control_flow: bool = True
) -> list[Instruction]:
  """The instructions of the optimised entry computation, or of the computation named
  `computation` (parameters and tuple plumbing left out), and, with `walk_control_flow`, of
  every computation it runs as control flow, recursively: conditional branches (a KIVI cache's
  flush runs in one), nested loops' bodies and conditions, calls."""
  text = compiled.as_text()
  # First the control-flow graph: per computation, its instructions and its callees (each with
  # whether it is called as a conditional's branch).
  graph, order = {}, []

  def read(name: str | None) -> None:
    if name in graph:
      return
    instructions, callees = [], []
    graph[name] = (instructions, callees)
    order.append(name)
    for line in _computation_body(text, name).splitlines():
      match = _INSTRUCTION.match(line)
      if match is None:
        continue
      shape, opcode = match.groups()
      if opcode in _CONTROL_FLOW and walk_control_flow:
        # Attributes only: metadata's op names and quoted strings may hold "body=" too.
        attributes = re.sub(r"metadata=\{[^}]*\}", "", re.sub(r'"[^"]*"', "", line))
        for groups in _CALLED.findall(attributes):
          for callee in ",".join(groups).split(","):
            callee = callee.strip().lstrip("%")
            if callee:
              callees.append((callee, opcode == "conditional"))
              read(callee)
      if opcode not in ("parameter", "get-tuple-element", "tuple", "constant", "bitcast"):
        instructions.append((opcode, shape))

  read(computation)
  # Every step: what is reached from `computation` without passing a conditional's branch.
  every_step, pending = {computation}, [computation]
  while pending:
    for callee, through_branch in graph[pending.pop()][1]:
      if not through_branch and callee not in every_step:
        every_step.add(callee)
        pending.append(callee)
  found = []
  for name in order:
    for opcode, shape in graph[name][0]:
      sized = shape[1:] if opcode == "copy-start" else shape
      found.append(
        Instruction(opcode, shape, laid_out_bytes(sized), name or "ENTRY", name not in every_step)
      )
  return found


def moves_memory_space_only(instruction: Instruction) -> bool:
  """Whether a copy-start only moves an array between memory spaces, its layout unchanged: XLA's
  memory-space assignment prefetching an operand into VMEM (`S(1)`) or evicting a result to
  HBM. Not a relayout: the bytes cross HBM once, as the kernel reading them there would."""
  if instruction.opcode != "copy-start":
    return False
  destination, source = _tuple_elements(instruction.shape)[:2]
  in_any_space = lambda shape: re.sub(r"S\(\d+\)", "", shape).replace(":}", "}")
  return in_any_space(destination) == in_any_space(source)


def _tuple_elements(shape: str) -> list[str]:
  """The element shapes of a tuple shape string ("(a, b, /*index=2*/c)")."""
  elements, depth, start = [], 0, 1
  for index, char in enumerate(shape):
    if char in "([{":
      depth += 1
    elif char in ")]}":
      depth -= 1
    if (char == "," and depth == 1) or (char == ")" and depth == 0):
      elements.append(re.sub(r"/\*.*?\*/", "", shape[start:index]).strip())
      start = index + 1
  return elements


def large_copies(compiled, min_bytes: int, computation: str | None = None) -> list[Instruction]:
  """Copies, transposes and relayouting copy-starts in the entry computation (or
  `computation`), and in what it runs as control flow (`entry_instructions`), whose result
  holds >= min_bytes; copy-starts that only move an array between memory spaces are left out
  (`moves_memory_space_only`)."""
  return [
    instruction
    for instruction in entry_instructions(compiled, computation)
    if instruction.opcode in COPY_OPCODES
    and instruction.bytes >= min_bytes
    and not moves_memory_space_only(instruction)
  ]


def while_body(compiled) -> str:
  """The name of the body of the optimised module's one top-level `while` loop (the entry
  computation's; loops XLA makes inside it, of a scatter or a sort, are not counted)."""
  text = compiled.as_text()
  entry = text[text.index("\nENTRY") :]
  entry = entry[: entry.index("\n}")]
  bodies = [
    re.search(r"\bbody=%?([\w.\-]+)", line).group(1)
    for line in entry.splitlines()
    if re.match(r"\s*(?:ROOT )?%[\w.\-]+ = .* while\(", line)
  ]
  if len(bodies) != 1:
    raise ValueError(f"expected one top-level while loop, found {len(bodies)}")
  return bodies[0]


def decode_loop(spec: str, *, context: int, head_dim: int, topology: str = "v5e:2x2"):
  """kvjax's own decode loop (`generate`'s, caches donated) compiled for a TPU: a one-layer
  random Llama with the benchmark's attention shapes (8 KV heads, 4 query heads each), batch 8,
  a cache of `method` holding `context` tokens, the TPU kernels (the dispatch is told the
  backend is a TPU: it picks kernels by the default backend, this machine's CPU)."""
  return _compiled_decode("lowered_decode_loop", spec, context, head_dim, topology)


def decode_step(spec: str, *, context: int, head_dim: int, topology: str = "v5e:2x2"):
  """`decode_loop`'s model and caches, but one decode step jitted alone (a caller's own loop),
  compiled for a TPU: its arguments, the caches among them, in the device's default layouts."""
  return _compiled_decode("lowered_decode_step", spec, context, head_dim, topology)


def _compiled_decode(lowering: str, spec: str, context: int, head_dim: int, topology: str):
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import decode_loop_lowering

  from kvjax.method_spec import parse_method_spec

  device = tpu_device(topology)
  sharding = jax.sharding.SingleDeviceSharding(device)
  placed = lambda tree: jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree
  )
  method = parse_method_spec(spec, implementation="pallas")
  with _without_compilation_cache():
    return getattr(decode_loop_lowering, lowering)(
      method,
      placed=placed,
      backend="tpu",
      platform="tpu",
      context=context,
      head_dim=head_dim,
      target=lambda: jax.default_device(device),
      compile_in_target=True,  # the compile, too, reads the default backend and device
    )


def record_shapes(head_dim: int, tokens: int, bits: int | None, stats_dtype=jnp.bfloat16):
  """(shape, dtype) arguments of a decode call at the benchmark shape: batch 8, 8 KV heads, 4
  query heads each, group 32; bits None for the bf16 cache."""
  batch, kv_heads, group = 8, 8, 4
  queries = ((batch, kv_heads, group, head_dim), jnp.bfloat16)
  lengths = ((batch,), jnp.int32)
  if bits is None:
    cache = ((batch, kv_heads, tokens, head_dim), jnp.bfloat16)
    return (queries, cache, cache, lengths)
  codes = ((batch, kv_heads, tokens, head_dim * bits // 32), jnp.uint32)
  key_stats = ((batch, kv_heads, tokens // 32, head_dim), stats_dtype)
  value_stats = ((batch, kv_heads, tokens, head_dim // 32), stats_dtype)
  return (queries, codes, key_stats, key_stats, codes, value_stats, value_stats, lengths)


def full_precision_call(sm_scale: float = 0.088, **config):
  from pallas_kernels import decode_attention_tpu

  return functools.partial(decode_attention_tpu.decode_attention_tpu, sm_scale=sm_scale, **config)


def quantized_call(bits: int, group_size: int = 32, sm_scale: float = 0.088, **config):
  from pallas_kernels import quantized_decode_attention_tpu

  return functools.partial(
    quantized_decode_attention_tpu.quantized_decode_attention_tpu,
    bits=bits,
    group_size=group_size,
    sm_scale=sm_scale,
    **config,
  )


def gear_call(bits: int, group_size: int, block: int = 64, **config):
  """`quantized_call` on a GEAR segment: the call's arguments are the quantized segment's eight
  (queries to lengths), then the four low-rank factors and the four outlier arrays."""
  call = quantized_call(bits, group_size, **config)
  return lambda *args: call(*args[:8], lowrank=args[8:12], outliers=args[12:16], block=block)


def check_record_shapes(topology: str, tokens: int) -> list[dict]:
  """Every TPU kernel at the benchmark shape: compiled, and its copies of >= 1 MB."""
  rows = []
  for head_dim in (64, 128):
    for bits in (None, 2, 4):
      call = full_precision_call() if bits is None else quantized_call(bits)
      name = "bf16" if bits is None else f"kivi{bits}"
      row = dict(kernel=name, head_dim=head_dim, tokens=tokens, topology=topology)
      try:
        compiled = compile_for_tpu(call, record_shapes(head_dim, tokens, bits), topology)
      except Exception as error:  # noqa: BLE001 - reported, not raised: the table lists them all
        row["error"] = str(error).split("\n")[0][:300]
      else:
        copies = large_copies(compiled, 1 << 20)
        row["copies"] = [dataclasses.asdict(copy) for copy in copies]
        row["copied_mb"] = round(sum(copy.bytes for copy in copies) / 1e6, 1)
      rows.append(row)
  return rows


DECODE_SPECS = {"kivi2": "kivi:bits=2,residual=128,group_size=32", "gear2": "gear"}


def decode_copies(topology: str, tokens: int) -> list[dict]:
  """Per KIVI-2 / GEAR-2 cache, head_dim 128 and 64, the decode step jitted alone and the decode
  loop (`decode_step`, `decode_loop`): the cache-sized arrays ([8, 8, ...]: batch 8, 8 KV heads)
  copied at every step, and the copies in the flush branch (every `residual` or GEAR `block`
  steps), of >= 1 MiB as laid out."""
  rows = []
  for name, spec in DECODE_SPECS.items():
    for head_dim in (128, 64):
      for kind, compile_decode in (("step", decode_step), ("loop", decode_loop)):
        compiled = compile_decode(spec, context=tokens, head_dim=head_dim, topology=topology)
        body = while_body(compiled) if kind == "loop" else None
        copies = [copy for copy in large_copies(compiled, 1 << 20, body) if "[8,8," in copy.shape]
        every_step = [copy for copy in copies if not copy.in_branch]
        branch = [copy for copy in copies if copy.in_branch]
        rows.append(
          dict(
            cache=name,
            head_dim=head_dim,
            decode=kind,
            topology=topology,
            tokens=tokens,
            every_step_copies=len(every_step),
            every_step_mib=sum(copy.bytes for copy in every_step) / 2**20,
            flush_copies=len(branch),
            flush_mib=sum(copy.bytes for copy in branch) / 2**20,
          )
        )
  return rows


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--topology", default="v5e:2x2", choices=TOPOLOGIES)
  parser.add_argument("--tokens", type=int, default=32768)
  parser.add_argument("--out", help="write the rows as JSON here")
  parser.add_argument(
    "--decode",
    action="store_true",
    help="kvjax's decode step and loop over KIVI-2 and GEAR-2 caches instead of the kernels",
  )
  args = parser.parse_args(argv)
  if args.decode:
    rows = decode_copies(args.topology, args.tokens)
    for row in rows:
      print(
        f"{row['topology']} {row['cache']} head_dim {row['head_dim']:3} {row['decode']}: "
        f"every step {row['every_step_copies']} copies, {row['every_step_mib']:.1f} MiB; "
        f"flush branch {row['flush_copies']} copies, {row['flush_mib']:.1f} MiB"
      )
  else:
    rows = check_record_shapes(args.topology, args.tokens)
    for row in rows:
      status = row.get("error") or f"compiles; copies of >= 1 MB: {row['copied_mb']} MB"
      print(f"{row['topology']} {row['kernel']:5} head_dim {row['head_dim']:3}: {status}")
      for copy in row.get("copies", []):
        print(f"    {copy['opcode']} {copy['shape']} ({copy['bytes'] / 1e6:.1f} MB laid out)")
  if args.out:
    with open(args.out, "w") as handle:
      json.dump(rows, handle, indent=1)


if __name__ == "__main__":
  main()
