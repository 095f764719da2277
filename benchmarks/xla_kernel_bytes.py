"""The kernels XLA's GPU backend makes of GEAR's terms, and the bytes each moves, without a GPU.

Compiles each part of GEAR's terms as `gear_terms_parts.py` times them on a GPU (the XLA side of
`gear_terms="xla"`, with the formulations before v21 and candidates beside the current ones), and
a whole KIVI-2 call on the GPU path (the folded Triton kernel, a custom call, with what XLA does
around it), for a compile-only H100 (`mosaic_static_cost.compile_only_device`: XLA's deviceless
compilation) and reads the optimised HLO's entry computation. Each instruction there that is not
a parameter, constant, bitcast or tuple access is one kernel launch (a fusion, a GEMM or Triton
custom call, a scatter, a copy); its bytes are the sizes of its distinct operands plus its result.

That is what the kernel must move if it reads every operand once; a GEMM tiled over a batch of
small matrices, a gather, or a reduction whose rows are re-read through L2 can move more, and a
scatter's atomic adds cost more than their bytes. So the count predicts the memory-bound parts'
floors and which formulation writes fewer intermediates, not their times: those come from
`gear_terms_parts.py` on a GPU. Autotuning needs a device, so GEMM tilings here are XLA's
defaults, not the ones a GPU run picks; the kernels and their operands are the same.

`--folded-mosaic-configs` adds, for each folded Mosaic GPU setting given, the kernels of a
standalone KIVI-2 call and those of one iteration of `decode_attention.time_op`'s timed loop (the
`while` body: what runs at every call once XLA has moved what it can out of the loop and chosen
the layouts it carries the cache in). `--decode-step-configs` adds, for each quantized kernel
setting, one step of kvjax's own decode loop (`decode_step_kernels`).

Setup: the environment of `mosaic_static_cost.py` (jax's CUDA plugin, no GPU and no CUDA driver
needed). Examples:

  PYTHONPATH=. .venv-mosaic-analysis/bin/python benchmarks/xla_kernel_bytes.py \
    [--context 32768] [--out results/xla_kernel_bytes_v21.json]
  PYTHONPATH=. .venv-mosaic-analysis/bin/python benchmarks/xla_kernel_bytes.py \
    --only-folded-mosaic --folded-mosaic-configs '[{"block_tokens": 64, "num_stages": 4,
    "key_operand": "registers", "operand_order": "word", "value_stats": "separate"}]'
"""

import argparse
import dataclasses
import functools
import json
import os
import re
import sys

from benchmarks.value_stats_layout import WHILE_BODY

# Read when jax loads its plugins (see mosaic_static_cost.py), so set before jax is imported.
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

ELEMENT_BYTES = {
  "pred": 1,
  "s8": 1,
  "u8": 1,
  "s16": 2,
  "u16": 2,
  "f16": 2,
  "bf16": 2,
  "s32": 4,
  "u32": 4,
  "f32": 4,
  "s64": 8,
  "u64": 8,
  "f64": 8,
}
NOT_KERNELS = {"parameter", "constant", "bitcast", "get-tuple-element", "tuple"}

_ARRAY = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$")
_OPERAND = re.compile(r"%([\w.\-]+)")
_LAYOUT = re.compile(r"\{[^}]*\}")  # f32[4,8]{1,0} -> f32[4,8]


@dataclasses.dataclass(frozen=True)
class Kernel:
  """One launch of the entry computation: its instruction name, opcode (a fusion's kind, e.g.
  "fusion:kLoop", or a custom call's target), result type without layouts and the bytes it
  reads and writes."""

  name: str
  opcode: str
  result: str
  bytes_read: int
  bytes_written: int


def type_bytes(hlo_type: str) -> int:
  """Bytes of an HLO type, a tuple's summed over its arrays ("f32[8,4]{1,0}" -> 128)."""
  total = 0
  for element, dims in _ARRAY.findall(hlo_type):
    if element not in ELEMENT_BYTES:
      raise ValueError(f"element type {element!r} has no known size (in {hlo_type!r})")
    count = 1
    for dim in filter(None, dims.split(",")):
      count *= int(dim)
    total += count * ELEMENT_BYTES[element]
  return total


def _split_type(rest: str) -> tuple[str, str]:
  """(result type, what follows it) of an instruction's right-hand side."""
  if rest.startswith("("):  # a tuple type: up to its matching parenthesis
    depth = 0
    for index, char in enumerate(rest):
      depth += {"(": 1, ")": -1}.get(char, 0)
      if depth == 0:
        return rest[: index + 1], rest[index + 1 :].lstrip()
  result, _, tail = rest.partition(" ")
  return result, tail


def _call_operands(tail: str) -> tuple[str, list[str]]:
  """(opcode, operand names) of `op(%a, %b), attributes`."""
  opcode, _, arguments = tail.partition("(")
  depth, end = 1, len(arguments)
  for index, char in enumerate(arguments):
    depth += {"(": 1, ")": -1}.get(char, 0)
    if depth == 0:
      end = index
      break
  return opcode.strip(), _OPERAND.findall(arguments[:end])


def entry_kernels(hlo_text: str) -> list[Kernel]:
  """The kernel launches of an optimised HLO module's entry computation, in program order."""
  return computation_kernels(hlo_text)


def while_body_kernels(hlo_text: str) -> list[Kernel]:
  """The kernel launches of the body of the module's one `while` loop: what runs at every
  iteration (a decode step, a timed call)."""
  bodies = WHILE_BODY.findall(hlo_text)
  if len(bodies) != 1:
    raise ValueError(f"expected one while loop, found {len(bodies)}")
  return computation_kernels(hlo_text, bodies[0])


def computation_kernels(hlo_text: str, name: str | None = None) -> list[Kernel]:
  """The kernel launches of one computation of an optimised HLO module (None: the entry
  computation), in program order."""
  lines = hlo_text.splitlines()
  if name is None:
    header, what = "ENTRY", "ENTRY computation"
  else:
    header, what = f"%{name} ", f"computation named {name!r}"
  starts = [index for index, line in enumerate(lines) if line.startswith(header)]
  if len(starts) != 1:
    raise ValueError(f"expected one {what}, found {len(starts)}")
  types: dict[str, str] = {}
  kernels = []
  for line in lines[starts[0] + 1 :]:
    if line.startswith("}"):
      break
    instruction = _INSTRUCTION.match(line)
    if not instruction:
      continue
    name, rest = instruction.groups()
    result, tail = _split_type(rest)
    types[name] = result
    opcode, operands = _call_operands(tail)
    if opcode in NOT_KERNELS:
      continue
    if opcode == "fusion":
      kind = re.search(r"\bkind=(\w+)", tail)
      opcode = f"fusion:{kind.group(1)}" if kind else opcode
    elif opcode == "custom-call":
      target = re.search(r'custom_call_target="([^"]+)"', tail)
      opcode = f"custom-call:{target.group(1)}" if target else opcode
    read = sum(type_bytes(types[operand]) for operand in dict.fromkeys(operands))
    kernels.append(Kernel(name, opcode, _LAYOUT.sub("", result), read, type_bytes(result)))
  return kernels


@functools.cache
def _compile_only_h100_sharding():
  """One compile-only H100 for the run: each topology makes devices of its own, and one jitted
  function's arguments must sit on one device."""
  import jax

  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import mosaic_static_cost

  return jax.sharding.SingleDeviceSharding(mosaic_static_cost.compile_only_device())


def _on_compile_only_h100(tree):
  """The abstract arrays of `tree` (shapes and dtypes) placed on the run's compile-only H100."""
  import jax

  sharding = _compile_only_h100_sharding()
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


def _settings_label(settings: dict) -> str:
  return ",".join(f"{key}={value}" for key, value in sorted(settings.items()))


def gear_parts_kernels(context: int) -> dict[str, list[Kernel]]:
  """part name -> its kernels, compiled for a compile-only H100 at `context` tokens."""
  import jax

  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import gear_terms_parts

  def abstract_inputs():
    queries, segment, lengths = gear_terms_parts.gear_segment(context)
    return gear_terms_parts.part_inputs(queries, lengths, context), segment

  placed = _on_compile_only_h100(jax.eval_shape(abstract_inputs))
  result = {}
  for name, fn in gear_terms_parts.parts(context).items():
    compiled = jax.jit(fn).trace(*placed).lower(lowering_platforms=("cuda",)).compile()
    result[name] = entry_kernels(compiled.as_text())
  return result


def _benchmark_call(function, context: int, bits: int, **settings) -> tuple:
  """(`function` bound to decode_attention.py's KIVI quantization and `settings`, its abstract
  arguments at `context` tokens placed on a compile-only H100)."""
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import mosaic_static_cost
  import triton_static_cost

  shape = mosaic_static_cost.BENCHMARK_SHAPE
  arguments = triton_static_cost.quantized_call_shapes(
    shape["batch"],
    shape["kv_heads"],
    shape["group"],
    shape["head_dim"],
    context,
    bits,
    shape["group_size"],
  )
  call = functools.partial(
    function,
    bits=bits,
    group_size=shape["group_size"],
    sm_scale=shape["head_dim"] ** -0.5,
    **settings,
  )
  return call, _on_compile_only_h100(list(arguments))


def kivi_call_kernels(context: int, bits: int = 2) -> list[Kernel]:
  """The kernels of one KIVI decode-attention call on the GPU path (the default kernel, folded
  Triton, with XLA's work around it) at decode_attention.py's shapes, for a compile-only H100."""
  import jax

  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import triton_static_cost

  from pallas_kernels.quantized_decode_attention_gpu import quantized_decode_attention_gpu

  call, placed = _benchmark_call(quantized_decode_attention_gpu, context, bits)
  with triton_static_cost.pallas_triton_for_h100():
    lowered = jax.jit(call).trace(*placed).lower(lowering_platforms=("cuda",))
  return entry_kernels(lowered.compile().as_text())


def folded_mosaic_call_kernels(context: int, settings: dict, bits: int = 2) -> dict:
  """{"call": kernels of one standalone jitted call, "timed loop": the kernels of one iteration
  of `decode_attention.time_op`'s loop} for the folded Mosaic GPU kernel with `settings` at
  decode_attention.py's shapes, for a compile-only H100. In the loop XLA may carry the cache in
  the layouts the kernel reads (a transpose then runs once, before the loop); what it computes
  from the cache runs at every call."""
  import jax

  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import decode_attention

  from pallas_kernels.quantized_decode_attention_folded_mosaic_gpu import (
    folded_decode_attention_mosaic_gpu,
  )

  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import triton_static_cost

  call, placed = _benchmark_call(folded_decode_attention_mosaic_gpu, context, bits, **settings)

  def compiled_text(function):
    # split_merge="triton" adds a Pallas-Triton kernel, which lowers only for a (faked) GPU
    with triton_static_cost.pallas_triton_for_h100():
      lowered = function.trace(*placed).lower(lowering_platforms=("cuda",))
    return lowered.compile().as_text()

  return {
    "call": entry_kernels(compiled_text(jax.jit(call))),
    "timed loop": while_body_kernels(compiled_text(decode_attention.timed_loop(call, iters=2))),
  }


def decode_step_kernels(context: int, quantized_settings: dict, bits: int = 2) -> list[Kernel]:
  """The kernels of one step of kvjax's decode loop (`generate`'s `while` body), compiled for a
  compile-only H100: a one-layer random Llama with decode_attention.py's attention shapes (8 KV
  heads, 4 query heads each, head_dim 128), batch 8, a KIVI cache (group 32, residual 128) of
  `context` tokens, the GPU kernels with `quantized_settings`. The model's layout choices are
  XLA's, as on a GPU: what it carries across steps and what it recomputes at every step.

  The cache's updates are scatters: their operand-plus-result bytes here are the arrays they
  update; a scatter XLA runs in place moves only its updates."""
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import mosaic_static_cost
  import triton_static_cost
  from decode_loop_lowering import lowered_decode_loop

  from kvjax.kernel_settings import KernelSettings
  from kvjax.method_spec import parse_method_spec

  shape = mosaic_static_cost.BENCHMARK_SHAPE
  method = parse_method_spec(
    f"kivi:bits={bits},residual=128,group_size={shape['group_size']}",
    implementation="pallas",
    kernel_settings=KernelSettings(quantized=quantized_settings),
  )
  lowered = lowered_decode_loop(
    method,
    placed=_on_compile_only_h100,
    backend="gpu",
    platform="cuda",
    context=context,
    kv_heads=shape["kv_heads"],
    group=shape["group"],
    head_dim=shape["head_dim"],
    batch=shape["batch"],
    target=triton_static_cost.pallas_triton_for_h100,
  )
  return while_body_kernels(lowered.compile().as_text())


def _print_kernels(name: str, kernels: list[Kernel]) -> None:
  total = sum(k.bytes_read + k.bytes_written for k in kernels)
  print(f"{name}: {len(kernels)} kernels, {total / 1e6:.1f} MB")
  for k in kernels:
    moved = (k.bytes_read + k.bytes_written) / 1e6
    print(f"    {k.opcode:<34} {k.result:<28} {moved:9.1f} MB  {k.name}")


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--context", type=int, default=32768)
  parser.add_argument(
    "--folded-mosaic-configs",
    default="[]",
    help="JSON list of folded Mosaic GPU kernel settings: for each, the kernels of a standalone "
    "KIVI-2 call and of one iteration of decode_attention.py's timed loop, e.g. '[{\"block_"
    'tokens": 64, "num_stages": 4, "value_stats": "separate"}]\'',
  )
  parser.add_argument(
    "--decode-step-configs",
    default="[]",
    help="JSON list of quantized kernel settings: for each, the kernels of one step of kvjax's "
    "decode loop (one layer, KIVI-2 cache of --context tokens)",
  )
  parser.add_argument(
    "--only-folded-mosaic",
    action="store_true",
    help="skip GEAR's parts and the folded Triton call",
  )
  parser.add_argument("--out", help="write the kernels of each part as JSON here")
  args = parser.parse_args()
  parts = {}
  if not args.only_folded_mosaic:
    parts = gear_parts_kernels(args.context)
    parts["KIVI-2 decode-attention call (folded Triton and XLA around it)"] = kivi_call_kernels(
      args.context
    )
  for settings in json.loads(args.folded_mosaic_configs):
    for where, kernels in folded_mosaic_call_kernels(args.context, settings).items():
      parts[f"KIVI-2 folded Mosaic GPU {where} ({_settings_label(settings)})"] = kernels
  for settings in json.loads(args.decode_step_configs):
    parts[f"decode step, one layer ({_settings_label(settings)})"] = decode_step_kernels(
      args.context, settings
    )
  for name, kernels in parts.items():
    _print_kernels(name, kernels)
  if args.out:
    with open(args.out, "w") as f:
      json.dump(
        {
          "context": args.context,
          "parts": {n: [dataclasses.asdict(k) for k in ks] for n, ks in parts.items()},
        },
        f,
        indent=1,
      )


if __name__ == "__main__":
  main()
