"""Which decode-attention call of a teacher-forced generate run a kernel gets wrong.

Every call goes through the kernels and through the jnp reference, on the same inputs.

`generate_kernels_check.py` compares tokens and `generate_logit_margins.py` compares logits;
neither says which call moved them: the quantized segment's kernel or the window's, at which
step, layer and row. Here the run follows the reference path (each call returns the reference's
result, so every call sees the reference's inputs), and each quantized-segment call and each
full-precision window call is also run through the kernels. The errors are printed per call and
row. `--dump DIR` saves the inputs of the worst call of each kind, and `--replay FILE` runs a saved
call again: for example a call saved on a GPU, replayed on the CPU in interpret mode.

    python benchmarks/attention_calls_check.py [--spec kivi:bits=2,residual=32]
        [--kernel-config '<quantized JSON>'] [--full-kernel-config '<JSON>']
        [--implementation pallas] [--steps 16] [--dump DIR]
    python benchmarks/attention_calls_check.py --replay DIR/worst_quantized_call.npz
        [--implementation interpret] [--kernel-config '<JSON>']

The model and prompts are `generate_kernels_check.py`'s: the tiny random Llama at head_dim 64,
with rows of 700 and 333 tokens.
"""

import argparse
import functools
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.generate_kernels_check import CONFIG, prompts_of_record
from benchmarks.generate_logit_margins import add_run_arguments, teacher_forced_logits
from kvjax import attention_dispatch
from kvjax.generate import generate
from kvjax.method_spec import parse_method_spec
from kvjax.prompt_batch import pack_prompts
from models.nnx_decoder import split_decoder
from models.weights import random_decoder
from pallas_kernels.quantized_decode_attention_gpu import WARP_MOSAIC_GPU_V59

# The dispatch functions a cache calls, their array arguments in order, and their static ones.
ARRAY_NAMES = {
  "quantized": ("queries", "k_codes", "k_scale", "k_min", "v_codes", "v_scale", "v_min", "lengths"),
  "window": ("queries", "keys", "values", "lengths"),
}
# The names the caches call them by in `attention_dispatch` (patched there during a check), and
# the functions themselves as imported.
DISPATCH_NAMES = {"quantized": "quantized_decode_attention", "window": "decode_attention"}
DISPATCH = {kind: getattr(attention_dispatch, name) for kind, name in DISPATCH_NAMES.items()}
STATIC_NAMES = {
  "quantized": ("bits", "group_size", "sm_scale", "block"),
  "window": ("sm_scale",),
}
# The warp variant with KERNEL_NOTES v59's settings: the default here, since the measured
# default keeps 2-bit codes at head_dim 64 off it.
DEFAULT_KERNEL_CONFIG = WARP_MOSAIC_GPU_V59


def row_errors(reference, kernel) -> list[dict]:
  """Per row of the batch: the largest |out difference|, the relative L2 error of out over the
  row's heads and query positions (absolute where the reference's row is 0), and the largest
  |lse difference| (0 where both are -inf, inf where one is). NaN in the kernel's row gives
  NaN."""
  out_r, lse_r = (np.asarray(x, np.float64) for x in reference)
  out_k, lse_k = (np.asarray(x, np.float64) for x in kernel)
  rows = []
  for b in range(out_r.shape[0]):
    difference = out_k[b] - out_r[b]
    norm = np.linalg.norm(out_r[b])
    both_empty = np.isneginf(lse_r[b]) & np.isneginf(lse_k[b])
    with np.errstate(invalid="ignore"):  # -inf - -inf where both are empty: selected away
      lse_difference = np.where(both_empty, 0.0, np.abs(lse_k[b] - lse_r[b]))
    error = np.linalg.norm(difference)
    rows.append(
      dict(
        max_abs=float(np.abs(difference).max()),
        relative=float(error / norm if norm else error),  # an empty row's out is 0
        max_lse=float(lse_difference.max()),
      )
    )
  return rows


def _badness(entry: dict) -> float:
  """The relative error, ranked worst where out or lse is NaN or one side of an lse is empty."""
  if not (np.isfinite(entry["relative"]) and np.isfinite(entry["max_lse"])):
    return np.inf
  return entry["relative"]


class CallRecorder:
  """Every call of each kind, in the order the decode steps make them, with its rows' errors,
  and the inputs of the worst call of each kind."""

  def __init__(self, implementation: str, kernel_configs: dict, layers: int):
    self.implementation = implementation
    self.kernel_configs = kernel_configs
    self.layers = layers
    self.entries: list[dict] = []
    self.worst: dict[str, tuple[float, dict, dict]] = {}
    self.counts = {kind: 0 for kind in ARRAY_NAMES}

  def checked(self, kind: str):
    """The dispatch function of `kind`, returning the reference's result after recording the
    kernel's error on the same arguments."""
    dispatch = DISPATCH[kind]

    def call(*arrays, implementation, kernel_config=None, kernel_backend=None, **static):
      del implementation, kernel_config  # the reference's result, the recorder's kernel setting
      if static.get("lowrank") is not None or static.get("outliers") is not None:
        raise ValueError("attention_calls_check takes KIVI and full caches only, not GEAR's terms")
      reference = dispatch(*arrays, implementation="reference", **static)
      kernel = dispatch(
        *arrays,
        implementation=self.implementation,
        kernel_config=self.kernel_configs[kind],
        kernel_backend=kernel_backend,
        **static,
      )
      scalars = {name: static[name] for name in STATIC_NAMES[kind] if name in static}
      jax.debug.callback(
        functools.partial(self.record, kind, scalars), arrays, reference, kernel, ordered=True
      )
      return reference

    return call

  def record(self, kind, scalars, arrays, reference, kernel):
    index = self.counts[kind]
    self.counts[kind] += 1
    lengths = np.asarray(arrays[-1])
    rows = row_errors(reference, kernel)
    for row, errors in enumerate(rows):
      self.entries.append(
        dict(
          kind=kind,
          call=index,
          step=index // self.layers + 1,  # the token whose logits it makes, as in the margins
          layer=index % self.layers,
          row=row,
          length=int(lengths[row]),
          **errors,
        )
      )
    badness = max(_badness(errors) for errors in rows)
    if kind not in self.worst or badness > self.worst[kind][0]:
      named = dict(zip(ARRAY_NAMES[kind], (np.asarray(a) for a in arrays), strict=True))
      self.worst[kind] = (badness, named, dict(scalars, call=index))


def save_call(path: pathlib.Path, kind: str, arrays: dict, scalars: dict, kernel_config: dict):
  """One call's inputs as .npz: each array by name (bfloat16 stored as its uint16 bits), and a
  JSON `meta` with the kind, the static arguments, the dtypes and the kernel setting."""
  dtypes = {name: str(array.dtype) for name, array in arrays.items()}
  stored = {
    name: array.view(np.uint16) if array.dtype == jnp.bfloat16 else array
    for name, array in arrays.items()
  }
  meta = dict(kind=kind, scalars=scalars, dtypes=dtypes, kernel_config=kernel_config)
  np.savez(path, meta=np.array(json.dumps(meta)), **stored)


def load_call(path) -> tuple[str, dict, dict, dict]:
  """(kind, arrays, static arguments, kernel setting) of a call saved by `save_call`."""
  with np.load(path) as saved:
    meta = json.loads(str(saved["meta"]))
    arrays = {}
    for name in ARRAY_NAMES[meta["kind"]]:
      array = saved[name]
      if meta["dtypes"][name] == "bfloat16":
        array = array.view(jnp.bfloat16)
      arrays[name] = jnp.asarray(array)
  scalars = {k: v for k, v in meta["scalars"].items() if k != "call"}
  return meta["kind"], arrays, scalars, meta["kernel_config"]


def replay(path, implementation: str, kernel_config: dict | None = None) -> list[dict]:
  """A saved call through the kernel (its saved setting, or `kernel_config`) against the
  reference: its rows' errors (`row_errors`), with each row's length."""
  kind, arrays, scalars, saved_config = load_call(path)
  config = saved_config if kernel_config is None else kernel_config
  dispatch = DISPATCH[kind]
  reference = dispatch(*arrays.values(), implementation="reference", **scalars)
  kernel = dispatch(
    *arrays.values(), implementation=implementation, kernel_config=config, **scalars
  )
  lengths = np.asarray(arrays["lengths"])
  return [
    dict(row=row, length=int(lengths[row]), **errors)
    for row, errors in enumerate(row_errors(reference, kernel))
  ]


def check_calls(
  spec: str,
  *,
  implementation: str,
  kernel_configs: dict,
  steps: int,
  cache_dtype,
) -> CallRecorder:
  """Every decode-attention call of `steps` teacher-forced steps (the reference path's tokens,
  the model and prompts of `generate_kernels_check.py`), recorded by kind."""
  if not spec.startswith(("kivi", "full")):
    raise ValueError(f"spec={spec!r}: attention_calls_check takes 'kivi:...' or 'full' specs")
  decoder, params = split_decoder(random_decoder(CONFIG, seed=0))
  prompts = prompts_of_record()
  method = parse_method_spec(spec, implementation="reference")
  reference_run = generate(
    decoder, params, prompts, max_new_tokens=steps, cache_dtype=cache_dtype, cache_method=method
  )
  tokens, lengths = pack_prompts(prompts)
  recorder = CallRecorder(implementation, kernel_configs, CONFIG.num_layers)
  originals = {kind: getattr(attention_dispatch, name) for kind, name in DISPATCH_NAMES.items()}
  try:
    for kind, name in DISPATCH_NAMES.items():
      setattr(attention_dispatch, name, recorder.checked(kind))
    teacher_forced_logits(
      decoder, params, tokens, lengths, reference_run.tokens, method, cache_dtype
    )
    jax.effects_barrier()
  finally:
    for kind, name in DISPATCH_NAMES.items():
      setattr(attention_dispatch, name, originals[kind])
  expected = (steps - 1) * CONFIG.num_layers
  kinds = ("quantized", "window") if spec.startswith("kivi") else ("window",)
  for kind in kinds:
    count = recorder.counts[kind]
    if count != expected:
      raise RuntimeError(
        f"{count} {kind} calls where {steps - 1} decode steps of {CONFIG.num_layers} layers make "
        f"{expected}: the step / layer labels would be wrong"
      )
  return recorder


def _print_rows(entries):
  print(f"{'kind':>9} {'step':>4} {'layer':>5} {'row':>3} {'length':>6} "
        f"{'max |dout|':>11} {'rel. L2':>9} {'max |dlse|':>10}")  # fmt: skip
  for e in entries:
    print(
      f"{e.get('kind', ''):>9} {e.get('step', ''):>4} {e.get('layer', ''):>5} {e['row']:3d} "
      f"{e['length']:6d} {e['max_abs']:11.3e} {e['relative']:9.2e} {e['max_lse']:10.3e}"
    )


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--spec", default="kivi:bits=2,residual=32")
  parser.add_argument(
    "--kernel-config",
    type=json.loads,
    default=None,
    help="quantized kernel setting (JSON); default: the warp variant with v59's settings "
    "(with --replay: the saved call's setting)",
  )
  parser.add_argument(
    "--full-kernel-config", type=json.loads, default={}, help="the window kernel's setting (JSON)"
  )
  add_run_arguments(parser)
  parser.add_argument("--dump", type=pathlib.Path, help="folder for the worst calls' inputs")
  parser.add_argument("--replay", type=pathlib.Path, help="a call saved by --dump, run again")
  args = parser.parse_args()
  if args.steps < 2:
    parser.error(f"--steps={args.steps}: at least 2 (one decode step)")
  print(jax.__version__, jax.devices())
  if args.replay:
    kind, *_, saved_config = load_call(args.replay)
    config = saved_config if args.kernel_config is None else args.kernel_config
    print(f"replay of a {kind} call ({args.replay}), {args.implementation}, {config}")
    _print_rows(replay(args.replay, args.implementation, args.kernel_config))
    return
  configs = dict(
    quantized=DEFAULT_KERNEL_CONFIG if args.kernel_config is None else args.kernel_config,
    window=args.full_kernel_config,
  )
  recorder = check_calls(
    args.spec,
    implementation=args.implementation,
    kernel_configs=configs,
    steps=args.steps,
    cache_dtype=jnp.dtype(args.cache_dtype),
  )
  print(f"{args.spec} {args.cache_dtype}, {args.implementation}, settings {configs}")
  _print_rows(recorder.entries)
  for kind in ARRAY_NAMES:
    entries = [e for e in recorder.entries if e["kind"] == kind]
    if not entries:
      continue
    worst = max(entries, key=_badness)
    relative = [e["relative"] for e in entries]
    print(
      f"{kind}: {len(entries)} rows, rel. L2 median {np.nanmedian(relative):.2e}, worst "
      f"{worst['relative']:.2e} at step {worst['step']}, layer {worst['layer']}, row "
      f"{worst['row']} (length {worst['length']})"
    )
  if args.dump:
    args.dump.mkdir(parents=True, exist_ok=True)
    for kind, (_, arrays, scalars) in recorder.worst.items():
      path = args.dump / f"worst_{kind}_call.npz"
      save_call(path, kind, arrays, scalars, configs[kind])
      print(f"saved {path} (call {scalars['call']})")


if __name__ == "__main__":
  main()
