"""`benchmarks/attention_calls_check.py`: the per-call errors, the saved calls and their replay,
and the wiring into a teacher-forced run (with a stand-in kernel that is wrong on one call)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import io_callback

from benchmarks import attention_calls_check as check
from kvjax import attention_dispatch
from pallas_kernels.random_inputs import random_quantized_segment, random_queries
from tests.pallas_kernels.kernel_checks import triton_interpret
from tests.pallas_kernels.test_quantized_decode_attention_warp_mosaic_gpu import RTOL


def test_row_errors_per_row_with_empty_rows_and_nan():
  out = np.ones((3, 2, 4, 8), np.float32)
  lse = np.zeros((3, 2, 4), np.float32)
  lse[2] = -np.inf  # an empty row in both
  out_k, lse_k = out.copy(), lse.copy()
  out_k[0, 1, 2, 3] += 0.5
  lse_k[0, 0, 0] = 0.25
  out_k[1, 0, 0, 0] = np.nan
  rows = check.row_errors((out, lse), (out_k, lse_k))
  assert rows[0]["max_abs"] == pytest.approx(0.5)
  assert rows[0]["relative"] == pytest.approx(0.5 / np.sqrt(64))
  assert rows[0]["max_lse"] == pytest.approx(0.25)
  assert np.isnan(rows[1]["relative"]) and check._badness(rows[1]) == np.inf
  assert rows[2] == dict(max_abs=0.0, relative=0.0, max_lse=0.0)
  lse_k[2, 1, 0] = 0.0  # one side empty, the other not
  row = check.row_errors((out, lse), (out_k, lse_k))[2]
  assert row["max_lse"] == np.inf and check._badness(row) == np.inf
  assert check._badness(rows[0]) == rows[0]["relative"]


def _quantized_call(seed=0, tokens=96):
  rng = np.random.default_rng(seed)
  segment = random_quantized_segment(
    rng, 2, 2, tokens, 64, bits=2, group_size=32, dtype=jnp.bfloat16
  )
  arrays = (random_queries(rng, 2, 2, 4, 64), *segment[:6], jnp.asarray([tokens, 40], jnp.int32))
  return arrays, dict(bits=2, group_size=32, sm_scale=0.125, block=32)


def test_a_saved_call_loads_bit_for_bit_and_replays(tmp_path):
  arrays, scalars = _quantized_call()
  named = dict(zip(check.ARRAY_NAMES["quantized"], (np.asarray(a) for a in arrays), strict=True))
  path = tmp_path / "call.npz"
  check.save_call(path, "quantized", named, dict(scalars, call=3), {"variant": "folded"})
  kind, loaded, loaded_scalars, config = check.load_call(path)
  assert (kind, loaded_scalars, config) == ("quantized", scalars, {"variant": "folded"})
  for name, array in named.items():
    assert loaded[name].dtype == array.dtype
    np.testing.assert_array_equal(np.asarray(loaded[name]), array)
  # the reference against itself: no error, each row's length kept
  rows = check.replay(path, "reference")
  assert [(r["row"], r["length"]) for r in rows] == [(0, 96), (1, 40)]
  assert all(r["max_abs"] == 0.0 and r["max_lse"] == 0.0 for r in rows)


def _wrong_on_call(kind, wrong_call, row):
  """A stand-in for a kernel of `kind`: the reference, with `row`'s output moved by 0.5 on the
  `wrong_call`-th call that is not the reference's (counted as it runs, not as it is traced).
  Also returns the settings it was traced with."""
  dispatch = check.DISPATCH[kind]
  configs, runs = [], []

  def count():
    runs.append(len(runs))
    return np.int32(runs[-1])

  def kernel(*arrays, implementation, kernel_config=None, kernel_backend=None, **static):
    out, lse = dispatch(*arrays, implementation="reference", **static)
    if implementation == "reference":
      return out, lse
    configs.append(kernel_config)
    call = io_callback(count, jax.ShapeDtypeStruct((), jnp.int32), ordered=True)
    return out.at[row].add(jnp.where(call == wrong_call, 0.5, 0.0)), lse

  return kernel, configs


def test_the_recorder_names_the_wrong_call_and_keeps_its_inputs(monkeypatch):
  kernel, configs = _wrong_on_call("quantized", wrong_call=1, row=1)
  monkeypatch.setitem(check.DISPATCH, "quantized", kernel)
  recorder = check.CallRecorder("interpret", {"quantized": {"variant": "x"}}, layers=2)
  checked = jax.jit(
    recorder.checked("quantized"), static_argnames=("implementation", "bits", "group_size",
                                                    "sm_scale", "block")
  )  # fmt: skip
  for seed in range(3):
    arrays, scalars = _quantized_call(seed)
    out, _ = checked(*arrays, implementation="reference", **scalars)
    # the reference's result is what the run goes on with
    reference, _ = check.DISPATCH["quantized"](*arrays, implementation="reference", **scalars)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(reference))
  jax.effects_barrier()
  assert configs == [{"variant": "x"}]  # traced once
  assert [(e["step"], e["layer"], e["row"]) for e in recorder.entries] == [
    (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1), (2, 0, 0), (2, 0, 1)
  ]  # fmt: skip
  errors = [e["max_abs"] for e in recorder.entries]
  assert errors[3] == pytest.approx(0.5) and max(errors[:3] + errors[4:]) == 0.0
  _, worst, scalars = recorder.worst["quantized"]
  assert scalars["call"] == 1 and scalars["bits"] == 2
  np.testing.assert_array_equal(worst["queries"], np.asarray(_quantized_call(1)[0][0]))


def test_gear_terms_are_refused_by_name():
  recorder = check.CallRecorder("interpret", {"quantized": {}}, layers=1)
  arrays, scalars = _quantized_call()
  with pytest.raises(ValueError, match="KIVI and full caches only"):
    recorder.checked("quantized")(*arrays, implementation="reference", lowrank=(1,), **scalars)


def test_other_specs_are_refused_by_name():
  with pytest.raises(ValueError, match="spec='gear:bits=2'.*'kivi:...' or 'full'"):
    check.check_calls(
      "gear:bits=2", implementation="interpret", kernel_configs={}, steps=2,
      cache_dtype=jnp.bfloat16,
    )  # fmt: skip


def test_a_teacher_forced_run_labels_every_call_by_step_layer_and_row(monkeypatch):
  """The tiny model's run (3 steps: 2 decode steps of 2 layers), with stand-in kernels: the
  quantized one wrong on its third call (step 2, layer 0), row 1; the dispatch restored after."""
  originals = (attention_dispatch.quantized_decode_attention, attention_dispatch.decode_attention)
  quantized, quantized_configs = _wrong_on_call("quantized", wrong_call=2, row=1)
  window, window_configs = _wrong_on_call("window", wrong_call=-1, row=0)
  monkeypatch.setitem(check.DISPATCH, "quantized", quantized)
  monkeypatch.setitem(check.DISPATCH, "window", window)
  configs = {"quantized": {"variant": "q"}, "window": {"lowering": "w"}}
  recorder = check.check_calls(
    "kivi:bits=2,residual=32", implementation="interpret", kernel_configs=configs, steps=3,
    cache_dtype=jnp.bfloat16,
  )  # fmt: skip
  assert (attention_dispatch.quantized_decode_attention, attention_dispatch.decode_attention) == (
    originals
  )
  assert set(map(str, quantized_configs)) == {"{'variant': 'q'}"}
  assert set(map(str, window_configs)) == {"{'lowering': 'w'}"}
  labels = [(e["kind"], e["step"], e["layer"], e["row"], e["length"]) for e in recorder.entries]
  # each layer's quantized call, then its window's; the rows' segments 672 and 320 tokens long,
  # their windows 29 and 14 at the first decode step
  assert labels[:4] == [
    ("quantized", 1, 0, 0, 672), ("quantized", 1, 0, 1, 320),
    ("window", 1, 0, 0, 29), ("window", 1, 0, 1, 14),
  ]  # fmt: skip
  assert len(labels) == 16
  wrong = [e for e in recorder.entries if e["max_abs"] > 0]
  assert [(e["kind"], e["step"], e["layer"], e["row"]) for e in wrong] == [("quantized", 2, 0, 1)]
  assert recorder.worst["quantized"][2]["call"] == 2


@pytest.mark.slow
def test_the_warp_kernel_passes_every_call_of_the_generate_check():
  """KERNEL_NOTES v59's divergence (bf16 KIVI-2 at head_dim 64: row 1 leaves the reference's
  tokens at its 8th token natively): the warp kernel with v59's settings on every quantized call
  of 8 teacher-forced steps, within the kernel tests' tolerances (interpret mode on the CPU; the
  kernel natively with KVJAX_NATIVE_KERNELS=1 on a GPU). 60 s in interpret mode."""
  recorder = check.check_calls(
    "kivi:bits=2,residual=32",
    implementation="interpret" if triton_interpret() else "pallas",
    kernel_configs={"quantized": check.DEFAULT_KERNEL_CONFIG, "window": {}},
    steps=8,
    cache_dtype=jnp.bfloat16,
  )
  quantized = [e for e in recorder.entries if e["kind"] == "quantized"]
  assert len(quantized) == 7 * 2 * 2  # steps x layers x rows
  worst = max(quantized, key=check._badness)
  assert worst["relative"] < RTOL, worst
  assert max(e["max_lse"] for e in quantized) < 3 * RTOL  # `assert_matches_reference`'s limit
