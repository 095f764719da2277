"""Static cost of the per-warp products design (`warp_products_experiment.cu`), no GPU.

The folded Mosaic GPU kernel takes both products as warpgroup MMAs: every 64-token block its
four warps meet at barriers (Q' and P' are staged in shared memory for wgmma's B operand) and
wait for the tensor core together. v34's profile put 30-40% of the loop's stall samples there
(KERNEL_NOTES v40, v44). The experiment writes the same loop with each warp taking its own
tokens through both products by `mma.sync` (m16n8k16), its operands built in registers, so no
barrier joins the warps in the loop; this script compiles it for sm_90a with nvcc and counts the
main loop's SASS as `triton_static_cost.py` and `mosaic_static_cost.py` do.

A warp's iteration takes 16 x TILES of a block's 64 x TILES tokens, so per 64 tokens of a
program each warp issues (loop without the copies + the copies' arm / 4) / TILES instructions on
average: the warp that refills a slot rotates with the block, and with no barrier in the loop
the warps wait for each other only through the ring. The folded Mosaic kernel's figure to set
beside it is its slowest warp per 64 tokens (the block's barriers wait for it): 339 for the
candidate C with matrix loads (`results/mosaic_static_cost_v43.json`).

Needs a CUDA >= 12.8 toolkit (nvcc, ptxas) under $MOSAIC_GPU_CUDA_ROOT (default
/usr/local/cuda) and the `triton` package (its cuobjdump and nvdisasm):

  PYTHONPATH=. .venv-mosaic-analysis/bin/python benchmarks/warp_products_experiment.py \
    --out benchmarks/results/warp_products_static_cost_v44.json

On a GPU, the same loop can be run and timed before anything of it is built into the library:
`--build DIR` (here, with nvcc) writes the variants' cubins and a manifest to DIR, and `--run
DIR` (on the GPU machine: numpy and the driver, through `cuda_driver`) checks each against a
numpy model of what the experiment computes (random inputs, a small shape: a wrong fragment
layout shows as an O(1) error) and times it at the benchmark's shape (8 x 8 rows of a 32k
KIVI-2 cache, 4 query heads per KV head, one launch per call, median of repeats; also at 8k
and 128k), with the device-to-device copy rate of the same run as the ceiling.
"""

import argparse
import collections
import ctypes
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile

import ml_dtypes
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import triton_static_cost  # noqa: E402
from sm90_occupancy import programs_per_sm  # noqa: E402

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "warp_products_experiment.cu")
WARPS = 4
HEAD_DIM = 128
REAL_ROWS = 4  # query rows per KV head (the products' N is 8: the padding rows repeat them)
WORDS_PER_TOKEN = HEAD_DIM * 2 // 32  # 2-bit codes
GROUP = 32  # tokens of a key group, channels of a value group
VALUE_GROUPS = HEAD_DIM // GROUP
KERNEL_NAME = "warp_products"
CHECK_TOLERANCE = {"out": 1e-2, "sums": 1e-3}  # relative to the largest magnitude of each
# The benchmark's shape: batch 8 x 8 KV heads, 32k tokens (also timed at 8k and 128k), splits of
# 1024 tokens (32 at 32k).
BENCHMARK_ROWS, BENCHMARK_TOKENS, SPLIT_TOKENS = 64, 32768, 1024
TIMED_CONTEXTS = (8192, 32768, 131072)
# The experiment's compile-time settings (its #ifndef defaults) and the values a variant may set.
DEFINES = {
  "TILES": (1, 2),
  "STAGES": (2, 3, 4),
  "UNROLL": (1, 2),
  "LENGTH_MASK": (0, 1),
  "QUERY_F32": (0, 1),
  "APPROX_EXP2": (0, 1),
  "RING_RELEASE": (0, 1),
}
VARIANTS = [
  {"TILES": 1},
  {"TILES": 2},
  {"TILES": 2, "APPROX_EXP2": 1},
  {"TILES": 2, "QUERY_F32": 1},
  {"TILES": 2, "LENGTH_MASK": 0},
  {"TILES": 2, "STAGES": 3},
  {"TILES": 1, "RING_RELEASE": 0},
  {"TILES": 2, "RING_RELEASE": 0},
]


def check_variant(variant: dict) -> None:
  """ValueError naming a setting the experiment does not take or a value it does not allow."""
  for key, value in variant.items():
    if key not in DEFINES:
      raise ValueError(f"{key!r} is not a setting of the experiment; allowed: {', '.join(DEFINES)}")
    if value not in DEFINES[key]:
      raise ValueError(f"{key}={value!r} is not supported; allowed: {DEFINES[key]}")


def per_program_tokens(with_copies: int, without_copies: int, tiles: int) -> dict:
  """Warp instructions per 64 tokens of a program: the mean over the four warps (each issues one
  block's refill in four), the warp issuing a refill, and the others; from the loop's count with
  and without the refill's arm."""
  arm = with_copies - without_copies
  if arm < 0:
    raise ValueError(f"the loop with the copies ({with_copies}) is shorter than without them")
  return {
    "copies_arm": arm,
    "mean": (without_copies + arm / WARPS) / tiles,
    "issuing_warp": with_copies / tiles,
    "other_warps": without_copies / tiles,
  }


def compile_cubin(variant: dict, workdir: str, name: str) -> str:
  """The experiment compiled for sm_90a with `variant`'s settings; the cubin's path."""
  root = os.environ.get("MOSAIC_GPU_CUDA_ROOT", "/usr/local/cuda")
  cubin = os.path.join(workdir, f"{name}.cubin")
  defines = [f"-D{key}={value}" for key, value in sorted(variant.items())]
  command = [os.path.join(root, "bin", "nvcc"), "-arch=sm_90a", "-cubin", "-O3", *defines]
  subprocess.run([*command, "-o", cubin, SOURCE], check=True)
  return cubin


def loop_count(cubin: str) -> dict:
  """The main loop's instructions and opcodes, registers, shared memory and live-register peak."""
  sass, usage = triton_static_cost.disassemble(cubin)
  loop = triton_static_cost.main_loop(triton_static_cost.parse_sass(sass))
  cost = triton_static_cost.loop_cost("", sass, usage, "", tokens_per_iteration=1, warps=WARPS)
  live, where = triton_static_cost.live_register_peak(
    triton_static_cost.live_registers_listing(cubin)
  )
  return {
    "instructions": len(loop),
    "opcodes": dict(collections.Counter(op.split(".")[0] for _, op, _ in loop).most_common()),
    "registers": cost.registers,
    "shared_bytes": cost.shared_bytes,
    "live_registers": live,
    "live_peak_at": where,
    "barriers": cost.barriers,
    "mma": cost.mma,
  }


def variant_row(variant: dict, workdir: str, index: int) -> dict:
  check_variant(variant)
  tiles = variant.get("TILES", 1)
  with_copies = loop_count(compile_cubin(variant, workdir, f"v{index}"))
  without = loop_count(compile_cubin({**variant, "COPIES": 0}, workdir, f"v{index}_no_copies"))
  return {
    "variant": variant,
    "tokens_per_iteration": 64 * tiles,
    **per_program_tokens(with_copies["instructions"], without["instructions"], tiles),
    "programs_per_sm": programs_per_sm(with_copies["registers"], with_copies["shared_bytes"]),
    "loop": with_copies,
    "loop_without_copies": without,
  }


class KernelInputs(ctypes.Structure):
  """The experiment's `Inputs` struct (device pointers, then tokens and splits)."""

  _fields_ = [
    (name, ctypes.c_uint64)
    for name in (
      "key_words",
      "value_words",
      "k_scale",
      "v_scale",
      "v_min",
      "key_bias",
      "queries",
      "reference",
      "lengths",
      "out",
      "sums",
    )
  ] + [("tokens", ctypes.c_int), ("splits", ctypes.c_int)]


def array_shapes(rows: int, tokens: int, splits: int) -> dict:
  """Each array of `KernelInputs`: (numpy dtype, shape)."""
  groups = tokens // GROUP
  return {
    "key_words": (np.uint32, (rows, tokens, WORDS_PER_TOKEN)),
    "value_words": (np.uint32, (rows, tokens, WORDS_PER_TOKEN)),
    "k_scale": (np.uint16, (rows, groups, HEAD_DIM)),  # bf16 bits
    "v_scale": (np.uint16, (rows, VALUE_GROUPS, tokens)),  # group-major, as the folded kernel's
    "v_min": (np.uint16, (rows, VALUE_GROUPS, tokens)),
    "key_bias": (np.float32, (rows, groups, REAL_ROWS)),
    "queries": (np.float32, (rows, REAL_ROWS, HEAD_DIM)),
    "reference": (np.float32, (rows, splits, REAL_ROWS)),
    "lengths": (np.int32, (rows,)),
    "out": (np.float32, (rows, splits, REAL_ROWS, HEAD_DIM)),
    # the sum of p, then of p v_min per value group
    "sums": (np.float32, (rows, splits, REAL_ROWS, 1 + VALUE_GROUPS)),
  }


def bf16_bits(values: np.ndarray) -> np.ndarray:
  """float32 -> bf16 bit patterns (uint16), rounded to nearest even, as the GPU converts."""
  return np.asarray(values, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)


def bf16_values(bits: np.ndarray) -> np.ndarray:
  """bf16 bit patterns (uint16) -> the float32 numbers they are (subnormals included)."""
  return np.asarray(bits, np.uint16).view(ml_dtypes.bfloat16).astype(np.float32)


def planar_codes(words: np.ndarray) -> np.ndarray:
  """uint32 [..., 8] planar words -> int [..., 128] codes: field f of word w is channel 8 f + w."""
  fields = (words[..., None, :] >> (2 * np.arange(16, dtype=np.uint32))[:, None]) & 3
  return fields.reshape(*words.shape[:-1], HEAD_DIM).astype(np.int64)


def code_exponents() -> np.ndarray:
  """int [128]: the bit at which each channel's code sits in its operand (`subnormal_codes`)."""
  field = np.arange(HEAD_DIM) // WORDS_PER_TOKEN
  return (2 * field) % 8


def split_tokens(tokens: int, splits: int, tiles: int) -> int:
  """Tokens of a split: an equal share, rounded up to whole blocks (as the experiment does)."""
  block = 64 * tiles
  share = -(-tokens // splits)
  return -(-share // block) * block


def model_outputs(arrays: dict, splits: int, tiles: int) -> tuple[np.ndarray, np.ndarray]:
  """(out [rows, splits, 4, 128], sums [rows, splits, 4, 5]) as the experiment computes them:
  Q' and P' rounded to bf16 where it rounds them, each channel's P' with its value group's
  scales, the codes' powers of two left in the output."""
  rows, tokens, _ = arrays["key_words"].shape
  per_split = split_tokens(tokens, splits, tiles)
  exponent = code_exponents()
  value_group = np.arange(HEAD_DIM) // GROUP
  # the lane's queries: q * 2^(69 - bit), rounded to bf16; Q' = bf16(that * k_scale)
  queries = bf16_values(bf16_bits(arrays["queries"] * 2.0 ** (69 - exponent)))
  k_scale = bf16_values(arrays["k_scale"])
  keys = planar_codes(arrays["key_words"]).astype(np.float64)
  values = planar_codes(arrays["value_words"]).astype(np.float64)
  v_scale, v_min = bf16_values(arrays["v_scale"]), bf16_values(arrays["v_min"])
  shapes = array_shapes(rows, tokens, splits)
  out = np.zeros(shapes["out"][1], np.float64)
  sums = np.zeros(shapes["sums"][1], np.float64)
  for r in range(rows):
    length = int(arrays["lengths"][r])
    for s in range(splits):
      start, stop = s * per_split, min((s + 1) * per_split, length, tokens)
      if stop <= start:
        continue
      t = np.arange(start, stop)
      scaled = bf16_values(bf16_bits(queries[r][:, None, :] * k_scale[r][t // GROUP][None]))
      # (code * 2^(bit - 133)) (q' * 2^(69 - bit)) summed, times 2^64: q' code
      scores = np.einsum("gtc,tc->gt", scaled * 2.0 ** (exponent - 69.0), keys[r, t])
      logits = scores + arrays["key_bias"][r][t // GROUP].T - arrays["reference"][r, s][:, None]
      p = np.exp2(logits.astype(np.float32)).astype(np.float64)  # [4, tokens]
      sums[r, s, :, 0] = p.sum(axis=1)
      sums[r, s, :, 1:] = np.einsum("gt,vt->gv", p, v_min[r][:, t])
      for group in range(VALUE_GROUPS):
        channels = value_group == group
        scaled_p = bf16_values(bf16_bits((p * v_scale[r, group, t] * 2.0**64).astype(np.float32)))
        out[r, s][:, channels] = scaled_p.astype(np.float64) @ values[r, t][:, channels]
  out *= 2.0 ** (exponent - 133.0)
  return out, sums


def random_arrays(rows: int, tokens: int, splits: int, seed: int = 0) -> dict:
  """Inputs for the check: random codes, statistics and queries; the last row shorter."""
  rng = np.random.default_rng(seed)
  shapes = array_shapes(rows, tokens, splits)
  words = lambda name: rng.integers(0, 2**32, shapes[name][1], dtype=np.uint64).astype(np.uint32)
  uniform = lambda name, low, high: rng.uniform(low, high, shapes[name][1]).astype(np.float32)
  return {
    "key_words": words("key_words"),
    "value_words": words("value_words"),
    "k_scale": bf16_bits(uniform("k_scale", 0.01, 0.1)),
    "v_scale": bf16_bits(uniform("v_scale", 0.01, 0.1)),
    "v_min": bf16_bits(uniform("v_min", -0.5, 0.5)),
    "key_bias": uniform("key_bias", -1.0, 1.0),
    "queries": rng.normal(0.0, 0.5, shapes["queries"][1]).astype(np.float32),
    "reference": np.full(shapes["reference"][1], 8.0, np.float32),
    "lengths": np.array([tokens] * (rows - 1) + [tokens - 100], np.int32),
  }


def _device_arrays(driver, rows: int, tokens: int, splits: int) -> tuple[dict, KernelInputs]:
  pointers = {}
  for name, (dtype, shape) in array_shapes(rows, tokens, splits).items():
    pointers[name] = driver.alloc(int(np.prod(shape)) * np.dtype(dtype).itemsize)
  parameters = KernelInputs(**pointers, tokens=tokens, splits=splits)
  return pointers, parameters


def check_on_gpu(driver, function, tiles: int, rows=4, tokens=2048, splits=2) -> dict:
  """The experiment against `model_outputs` on random inputs: the largest error of out and of
  the sums, relative to the largest magnitude of each."""
  arrays = random_arrays(rows, tokens, splits)
  pointers, parameters = _device_arrays(driver, rows, tokens, splits)
  shapes = array_shapes(rows, tokens, splits)
  for name, array in arrays.items():
    driver.upload(pointers[name], np.ascontiguousarray(array))
  for name in ("out", "sums"):
    driver.fill32(pointers[name], 0, int(np.prod(shapes[name][1])))
  driver.launch(function, (rows, splits, 1), (WARPS * 32, 1, 1), parameters)
  driver.synchronize()
  results = {}
  for name in ("out", "sums"):
    results[name] = np.zeros(shapes[name][1], np.float32)
    driver.download(results[name], pointers[name])
  for pointer in pointers.values():
    driver.free(pointer)
  out, sums = model_outputs(arrays, splits, tiles)
  errors = {
    "out_error": float(np.abs(results["out"] - out).max() / np.abs(out).max()),
    "sums_error": float(np.abs(results["sums"] - sums).max() / np.abs(sums).max()),
    "nan": bool(np.isnan(results["out"]).any() or np.isnan(results["sums"]).any()),
  }
  # The same roundings on both sides: what is left is the order of the f32 sums and exp2's last
  # bits flipping a bf16 rounding of P' now and then; a wrong fragment layout is off by O(1).
  errors["check_passed"] = (
    errors["out_error"] <= CHECK_TOLERANCE["out"]
    and errors["sums_error"] <= CHECK_TOLERANCE["sums"]
    and not errors["nan"]
  )
  return errors


def bytes_read(rows: int, tokens: int, splits: int) -> int:
  """What the experiment reads: the codes, the key scales, the value statistics and the key bias
  (XLA's q . k_min, which reads k_min in a pass of its own, is not counted)."""
  shapes = array_shapes(rows, tokens, splits)
  names = ("key_words", "value_words", "k_scale", "v_scale", "v_min", "key_bias")
  return sum(int(np.prod(shapes[n][1])) * np.dtype(shapes[n][0]).itemsize for n in names)


def time_on_gpu(driver, function, *, tokens=BENCHMARK_TOKENS, iters=100, repeats=7) -> dict:
  """Median microseconds per launch at the benchmark's shape with `tokens` tokens a row, in
  splits of SPLIT_TOKENS (constant inputs: the loop's work does not depend on the values)."""
  rows, splits = BENCHMARK_ROWS, tokens // SPLIT_TOKENS
  pointers, parameters = _device_arrays(driver, rows, tokens, splits)
  shapes = array_shapes(rows, tokens, splits)
  fills = {
    "key_words": 0x5A5A5A5A,
    "value_words": 0xA5A5A5A5,
    "k_scale": 0x3C003C00,  # bf16 pairs of 2^-7
    "v_scale": 0x3C003C00,
    "v_min": 0,
    "key_bias": 0,
    "queries": 0x3C23D70A,  # 0.01f
    "reference": 0,
    "lengths": tokens,
    "out": 0,
    "sums": 0,
  }
  for name, value in fills.items():
    dtype, shape = shapes[name]
    driver.fill32(pointers[name], value, int(np.prod(shape)) * np.dtype(dtype).itemsize // 4)

  def launch():
    driver.launch(function, (rows, splits, 1), (WARPS * 32, 1, 1), parameters)

  driver.milliseconds(launch, 3)  # warm-up
  samples = [driver.milliseconds(launch, iters) / iters * 1e3 for _ in range(repeats)]
  for pointer in pointers.values():
    driver.free(pointer)
  microseconds = statistics.median(samples)
  nbytes = bytes_read(rows, tokens, splits)
  return {"us": microseconds, "bytes": nbytes, "gbps": nbytes / microseconds / 1e3}


def copy_rate(driver, nbytes=1 << 30, iters=20, repeats=5) -> float:
  """GB/s of device-to-device copies (bytes read plus bytes written), the same run's ceiling."""
  source, destination = driver.alloc(nbytes), driver.alloc(nbytes)
  driver.fill32(source, 1, nbytes // 4)
  driver.milliseconds(lambda: driver.copy(destination, source, nbytes), 2)
  samples = [
    driver.milliseconds(lambda: driver.copy(destination, source, nbytes), iters) / iters
    for _ in range(repeats)
  ]
  driver.free(source)
  driver.free(destination)
  return 2 * nbytes / (statistics.median(samples) * 1e-3) / 1e9


def source_digest() -> str:
  """sha256 of the experiment's source: a built directory records it, so stale cubins show."""
  with open(SOURCE, "rb") as f:
    return hashlib.sha256(f.read()).hexdigest()


def build(variants: list, directory: str) -> None:
  """The variants' cubins (refills in the loop) and a manifest, for `run_on_gpu`."""
  os.makedirs(directory, exist_ok=True)
  entries = []
  for index, variant in enumerate(variants):
    check_variant(variant)
    name = f"variant{index}"
    compile_cubin(variant, directory, name)
    entries.append({"variant": variant, "cubin": f"{name}.cubin"})
  with open(os.path.join(directory, "manifest.json"), "w") as f:
    json.dump({"source_sha256": source_digest(), "cubins": entries}, f, indent=1)


def run_on_gpu(directory: str, driver=None) -> list:
  """Each cubin of `directory` checked (`check_on_gpu`) and timed (`time_on_gpu`, at each of
  TIMED_CONTEXTS), with the copy rate of the same run; `driver` a `cuda_driver.Driver` (made
  here by default)."""
  if driver is None:
    import cuda_driver

    driver = cuda_driver.Driver()
  device = driver.name()
  with open(os.path.join(directory, "manifest.json")) as f:
    manifest = json.load(f)
  if manifest["source_sha256"] != source_digest():
    raise ValueError(f"the cubins in {directory} were built from another source; rebuild them")
  ceiling = copy_rate(driver)
  rows = []
  for entry in manifest["cubins"]:
    with open(os.path.join(directory, entry["cubin"]), "rb") as f:
      function = driver.load_function(f.read(), KERNEL_NAME)
    tiles = entry["variant"].get("TILES", 1)
    row = {"variant": entry["variant"], "device": device, "copy_gbps": ceiling}
    row.update(check_on_gpu(driver, function, tiles))
    row["contexts"] = {}
    for tokens in TIMED_CONTEXTS:
      timing = time_on_gpu(driver, function, tokens=tokens)
      timing["percent_of_copy"] = 100 * timing["gbps"] / ceiling
      row["contexts"][tokens] = timing
    row.update(row["contexts"][BENCHMARK_TOKENS])  # the shape, at the top level
    rows.append(row)
    print(json.dumps(row), flush=True)
  return rows


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument(
    "--variants",
    default=json.dumps(VARIANTS),
    help='JSON list of settings, e.g. \'[{"TILES": 2, "APPROX_EXP2": 1}]\'',
  )
  parser.add_argument("--out", help="write the rows as JSON here")
  parser.add_argument("--build", metavar="DIR", help="write the variants' cubins here (nvcc)")
  parser.add_argument("--run", metavar="DIR", help="check and time the cubins of DIR on a GPU")
  args = parser.parse_args()
  variants = json.loads(args.variants)
  for variant in variants:
    check_variant(variant)
  if args.build:
    build(variants, args.build)
    return
  if args.run:
    rows = run_on_gpu(args.run)
    if args.out:
      with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    return
  with tempfile.TemporaryDirectory() as workdir:
    rows = [variant_row(variant, workdir, index) for index, variant in enumerate(variants)]
  print(
    "| settings | regs | live regs | shared KB | programs/SM | loop | copies arm "
    "| per 64 tokens: mean | issuing warp | others | HMMA | barriers |"
  )
  print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
  for row in rows:
    loop = row["loop"]
    print(
      f"| {json.dumps(row['variant'])} | {loop['registers']} | {loop['live_registers']} "
      f"| {loop['shared_bytes'] / 1024:.1f} | {row['programs_per_sm']} | {loop['instructions']} "
      f"| {row['copies_arm']} | {row['mean']:.1f} | {row['issuing_warp']:.1f} "
      f"| {row['other_warps']:.1f} | {loop['mma']} | {loop['barriers']} |"
    )
  for row in rows:
    print(f"{json.dumps(row['variant'])} without copies: {row['loop_without_copies']['opcodes']}")
  if args.out:
    with open(args.out, "w") as f:
      json.dump(rows, f, indent=1)


if __name__ == "__main__":
  main()
