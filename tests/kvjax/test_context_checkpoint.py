import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.compressed_context import (
  _continue_in_jit,
  compress_context,
  context_template,
  continue_context,
)
from kvjax.context_checkpoint import (
  METADATA_FILE,
  describe_structure,
  read_context_record,
  restore_context,
  save_context,
)
from kvjax.dense_cache import DenseLayerCache
from kvjax.kivi_cache import KiviLayerCache
from kvjax.method_spec import parse_method_spec
from tests.kvjax.test_compressed_context import QUESTIONS, assert_same_arrays
from tests.kvjax.test_method_matrix import CASES, PROMPTS
from tests.kvjax.tiny_decoder import TINY_CONFIG, tiny_decoder

ROOM = 8
KIVI = "kivi:bits=2,group_size=16,residual=16"


def _context(spec, layer_loop="unroll", room=ROOM, implementation="auto"):
  decoder, params = tiny_decoder(layer_loop=layer_loop)
  method = parse_method_spec(spec, implementation=implementation)
  return compress_context(decoder, params, PROMPTS, cache_method=method, room=room)


def _template(spec, layer_loop="unroll", room=ROOM, implementation="auto"):
  decoder, params = tiny_decoder(layer_loop=layer_loop)
  method = parse_method_spec(spec, implementation=implementation)
  return context_template(decoder, params, batch=2, prompt_len=40, cache_method=method, room=room)


@pytest.mark.parametrize(
  "layer_loop, spec",
  [("unroll", c[1]) for c in CASES]
  + [("scan", KIVI), ("scan", "gear:bits=2,group_size=16,block=16,rank=2")],
  ids=[
    "unroll-" + c[1].replace(",profile={profile}", "").replace(",profile={gates}", "")
    for c in CASES
  ]
  + ["scan-kivi", "scan-gear"],
)
def test_a_restored_context_holds_the_saved_arrays(
  layer_loop, spec, profile_path, gates_path, tmp_path
):
  spec = spec.format(profile=profile_path, gates=gates_path)
  context = _context(spec, layer_loop)
  disk_bytes = save_context(tmp_path / "context", context, metadata={"spec": spec})
  restored = restore_context(tmp_path / "context", _template(spec, layer_loop))

  assert_same_arrays(restored, context)
  assert restored.cache_bytes == context.cache_bytes
  record = read_context_record(tmp_path / "context")
  assert record["cache_bytes"] == context.cache_bytes and record["metadata"] == {"spec": spec}
  files = [f for f in (tmp_path / "context").rglob("*") if f.is_file()]
  assert disk_bytes == sum(f.stat().st_size for f in files)


def test_a_restored_context_answers_with_the_program_compiled_for_the_saved_one(tmp_path):
  """Restored arrays are committed to their device; a compressed context's are too, so both
  take the one compiled continue_context program."""
  decoder, params = tiny_decoder()
  context = _context(KIVI)
  save_context(tmp_path / "context", context)
  restored = restore_context(tmp_path / "context", _template(KIVI))
  ask = lambda ctx: continue_context(decoder, params, ctx, QUESTIONS, max_new_tokens=4)
  expected = ask(context)
  compiled = _continue_in_jit._cache_size()
  np.testing.assert_array_equal(ask(restored)[0], expected[0])
  assert _continue_in_jit._cache_size() == compiled


RESTORE_IN_ANOTHER_PROCESS = """
import sys
import numpy as np
from kvjax.compressed_context import continue_context
from kvjax.context_checkpoint import restore_context
from tests.kvjax.test_context_checkpoint import QUESTIONS, _template
from tests.kvjax.tiny_decoder import TINY_CONFIG, tiny_decoder

decoder, params = tiny_decoder(layer_loop="scan")
restored = restore_context(sys.argv[1], _template(sys.argv[2], "scan"))
print(continue_context(decoder, params, restored, QUESTIONS, max_new_tokens=4)[0].tolist())
"""


def test_a_context_restored_in_another_process_answers_as_the_saved_one(tmp_path):
  decoder, params = tiny_decoder(layer_loop="scan")
  spec = f"snapkv:budget=16,window=4+{KIVI}"
  context = _context(spec, "scan")
  save_context(tmp_path / "context", context)
  expected = continue_context(decoder, params, context, QUESTIONS, max_new_tokens=4)[0]
  repository = pathlib.Path(__file__).parents[2]
  run = subprocess.run(
    [sys.executable, "-c", RESTORE_IN_ANOTHER_PROCESS, str(tmp_path / "context"), spec],
    cwd=repository,
    env=dict(os.environ, PYTHONPATH=str(repository), JAX_PLATFORMS="cpu"),
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert run.returncode == 0, run.stderr[-2000:]
  assert json.loads(run.stdout.strip().splitlines()[-1]) == expected.tolist()


def test_arrays_without_elements_are_rebuilt_from_the_template(tmp_path):
  # 40 + 2 tokens are fewer than one block of 64: the quantized segment has no slots.
  spec = "kivi:bits=2,group_size=16,residual=64"
  context = _context(spec, room=2)
  empty = [leaf.shape for leaf in jax.tree.leaves(context) if leaf.size == 0]
  assert empty
  save_context(tmp_path / "context", context)
  assert_same_arrays(restore_context(tmp_path / "context", _template(spec, room=2)), context)


def test_a_context_of_arrays_serves_as_template_and_gives_its_shardings(tmp_path):
  context = _context(KIVI)
  save_context(tmp_path / "context", context)
  template = jax.tree.map(jnp.zeros_like, _context(KIVI))
  restored = restore_context(tmp_path / "context", template)
  assert_same_arrays(restored, context)
  for leaf, like in zip(jax.tree.leaves(restored), jax.tree.leaves(template)):
    assert leaf.sharding == like.sharding


@pytest.mark.parametrize(
  "saved, wanted, where",
  [
    # Other bits (and code shapes): the codec differs first.
    (KIVI, "kivi:bits=4,group_size=16,residual=16", r"codec.*bits=2.*bits=4"),
    # Same shapes, another meaning: only the static settings tell them apart.
    ("streaming:budget=16,sinks=2", "streaming:budget=16,sinks=4", "sinks"),
    ("snapkv:budget=16,window=4", "h2o:budget=16,window=4", "selector"),
    # Another method altogether.
    ("full", KIVI, "type"),
  ],
)
def test_a_template_of_another_configuration_is_refused(saved, wanted, where, tmp_path):
  save_context(tmp_path / "context", _context(saved))
  with pytest.raises(ValueError, match=f"does not fit the template: at context.caches.*{where}"):
    restore_context(tmp_path / "context", _template(wanted))


def test_another_room_or_layer_loop_is_refused(tmp_path):
  save_context(tmp_path / "context", _context(KIVI))
  with pytest.raises(ValueError, match="shape"):
    restore_context(tmp_path / "context", _template(KIVI, room=ROOM + 64))
  with pytest.raises(
    ValueError,
    match="saved from a decoder with layer_loop='unroll' and the template comes from "
    "one with layer_loop='scan'",
  ):
    restore_context(tmp_path / "context", _template(KIVI, layer_loop="scan"))


def _drop_settings(structure, names):
  """A saved description as kvjax wrote it before these settings existed."""
  if isinstance(structure, list):
    return [_drop_settings(child, names) for child in structure]
  if not isinstance(structure, dict):
    return structure
  dropped = {key: _drop_settings(value, names) for key, value in structure.items()}
  if isinstance(structure.get("settings"), dict):
    dropped["settings"] = {k: v for k, v in structure["settings"].items() if k not in names}
  return dropped


@pytest.mark.parametrize("spec", ["streaming:budget=16,sinks=2", "h2o_decode:budget=16,window=4"])
def test_a_context_saved_before_the_room_and_rope_settings_still_restores(spec, tmp_path):
  """Those settings' old behaviour (evicting when full, plain RoPE) is what such a save held."""
  context = _context(spec)  # 40-token prompts over a budget of 16: evicting, as before
  save_context(tmp_path / "context", context)
  path = tmp_path / "context" / METADATA_FILE
  record = json.loads(path.read_text())
  record["structure"] = _drop_settings(record["structure"], {"evicts_when_full", "rope_scaling"})
  path.write_text(json.dumps(record))
  assert_same_arrays(restore_context(tmp_path / "context", _template(spec)), context)
  # under its budget the cache now reports room: an old save of it evicted, and is refused
  small = f"{spec.split(',')[0].replace('16', '64')},{spec.split(',')[1]}"
  with pytest.raises(ValueError, match="evicts_when_full"):
    restore_context(tmp_path / "context", _template(small))


def test_a_selection_context_restores_as_every_kvjax_since_the_first_described_it(tmp_path):
  """A selection over a codec storage got a chunked-prefill scratch on 2026-11-24: a child that
  is None outside chunked prefill, and a static scratch layout that its storage's arrays tell.
  Saves of 2026-11-23 lack both (their restore was refused until v66), saves from 2026-11-24 to
  v65 describe the layout, and now it is left out like the other run settings."""
  spec = f"snapkv:budget=16,window=4+{KIVI}"
  context = _context(spec)
  save_context(tmp_path / "context", context)
  path = tmp_path / "context" / METADATA_FILE
  record = json.loads(path.read_text())
  cache = record["structure"]["children"]["caches"][0]
  assert cache["type"] == "SelectedLayerCache" and "scratch_layout" not in cache["settings"]
  assert cache["children"]["scratch"] is None
  assert_same_arrays(restore_context(tmp_path / "context", _template(spec)), context)
  del cache["children"]["scratch"]  # as 2026-11-23 wrote it
  path.write_text(json.dumps(record))
  assert_same_arrays(restore_context(tmp_path / "context", _template(spec)), context)
  cache["children"]["scratch"] = None  # as 2026-11-24 to v65 wrote it
  cache["settings"]["scratch_layout"] = repr(context.caches[0].scratch_layout)
  assert context.caches[0].scratch_layout == (2, 16, "bfloat16")
  path.write_text(json.dumps(record))
  assert_same_arrays(restore_context(tmp_path / "context", _template(spec)), context)
  # A child that holds arrays in the template is never taken as added later.
  del cache["children"]["storage"]
  path.write_text(json.dumps(record))
  with pytest.raises(ValueError, match=r"at context.caches\[0\] \(keys\)"):
    restore_context(tmp_path / "context", _template(spec))


SAVED_BY_OLDER_KVJAX = pathlib.Path(__file__).parents[1] / "fixtures" / "saved_contexts"


@pytest.mark.parametrize(
  "saved, spec",
  [
    (
      "e7a6b80-pyramidkv-kivi-scan",
      "pyramidkv:budget=16,window=4+kivi:bits=4,group_size=16,residual=16",
    ),
    ("59c9acd-gear-scan", "gear:bits=4,group_size=16,block=16,rank=2,outliers=0.02"),
  ],
)
@pytest.mark.filterwarnings("ignore:compress_context. pyramidkv's budgets follow:UserWarning")
def test_a_context_saved_by_an_older_kvjax_restores_as_compressed_now(saved, spec):
  """Saved by `scripts/saved_context_compat.py save` at e7a6b80 (2026-11-23, the first day of
  save_context: no chunked-prefill scratch in a selection) and at 59c9acd (v64: GEAR's codec
  described without stored outlier slots), scanned layers, room 8, with XLA's default flags. Both
  were refused before v66. Restored into templates made now, they hold what a context
  compressed now holds, up to the last bits a forward pass compiled otherwise rounds (these
  tests' fast-compile flags moved 1-4 of 512-2048 bfloat16 entries of some arrays by one unit
  in the last place; every code and index stayed): the orbax and format of today read them."""
  template = _template(spec, "scan")
  restored = restore_context(SAVED_BY_OLDER_KVJAX / saved, template)
  assert jax.tree.structure(restored) == jax.tree.structure(template)
  now = jax.tree_util.tree_leaves_with_path(_context(spec, "scan"))
  for held, (path, want) in zip(jax.tree.leaves(restored), now, strict=True):
    held, want = np.asarray(held), np.asarray(want)
    assert (held.shape, held.dtype) == (want.shape, want.dtype), jax.tree_util.keystr(path)
    if np.issubdtype(held.dtype, np.integer):  # codes, indices, lengths: a rare flip at most
      assert np.sum(held != want) <= 0.01 * held.size, jax.tree_util.keystr(path)
    else:  # two units in the last place of bfloat16
      np.testing.assert_allclose(
        held.astype(np.float32), want.astype(np.float32), rtol=2**-7, atol=1e-5
      )


def test_how_a_cache_runs_comes_from_the_template(tmp_path):
  save_context(tmp_path / "context", _context(KIVI, implementation="reference"))
  template = _template(KIVI, implementation="interpret")
  restored = restore_context(tmp_path / "context", template)
  assert jax.tree.structure(restored) == jax.tree.structure(template)
  assert restored.caches[0].implementation == "interpret"


def test_saving_never_replaces_what_is_not_a_saved_context(tmp_path):
  first = _context(KIVI)
  second = dataclasses.replace(first, lengths=jnp.asarray([7, 5], jnp.int32))
  save_context(tmp_path / "context", first)
  with pytest.raises(FileExistsError, match="pass overwrite=True"):
    save_context(tmp_path / "context", second)
  save_context(tmp_path / "context", second, overwrite=True)
  restored = restore_context(tmp_path / "context", _template(KIVI))
  np.testing.assert_array_equal(restored.lengths, [7, 5])

  other = tmp_path / "notes"
  other.mkdir()
  (other / "keep.txt").write_text("mine")
  with pytest.raises(FileExistsError, match="holds no saved context"):
    save_context(other, first, overwrite=True)
  assert (other / "keep.txt").read_text() == "mine"


def test_an_overwrite_that_fails_leaves_the_saved_context_as_it_was(tmp_path, monkeypatch):
  import orbax.checkpoint as ocp

  first = _context(KIVI)
  save_context(tmp_path / "context", first, metadata={"doc": "first"})

  def full_disk(self, *args, **kwargs):
    raise OSError(28, "No space left on device")

  monkeypatch.setattr(ocp.StandardCheckpointer, "save", full_disk)
  second = dataclasses.replace(first, lengths=jnp.asarray([7, 5], jnp.int32))
  with pytest.raises(OSError, match="No space left"):
    save_context(tmp_path / "context", second, overwrite=True)
  monkeypatch.undo()
  # The first save was removed before the second was written, and lost with its failure.
  assert read_context_record(tmp_path / "context")["metadata"] == {"doc": "first"}
  restored = restore_context(tmp_path / "context", _template(KIVI))
  np.testing.assert_array_equal(restored.lengths, first.lengths)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["context"]  # nothing partial left


def test_an_overwrite_through_a_link_replaces_what_it_points_to(tmp_path):
  first = _context(KIVI)
  save_context(tmp_path / "real", first, metadata={"v": 1})
  (tmp_path / "current").symlink_to(tmp_path / "real")
  # What an interrupted save of the same name leaves behind must not block this one.
  (tmp_path / ".real.replaced-1").mkdir()
  (tmp_path / ".real.replaced-1" / "x").write_text("left over")
  save_context(tmp_path / "current", first, metadata={"v": 2}, overwrite=True)
  assert (tmp_path / "current").is_symlink()  # it was replaced by a directory
  assert read_context_record(tmp_path / "real")["metadata"] == {"v": 2}
  names = sorted(p.name for p in tmp_path.iterdir())
  assert names == [".real.replaced-1", "current", "real"]  # nothing of its own left


def test_bad_input_is_refused_before_anything_is_written(tmp_path):
  context = _context(KIVI)
  with pytest.raises(ValueError, match="metadata must be JSON-serialisable"):
    save_context(tmp_path / "a", context, metadata={"array": np.ones(2)})
  with pytest.raises(ValueError, match="context must be a kvjax.compressed_context"):
    save_context(tmp_path / "a", context.caches)
  with pytest.raises(ValueError, match="overwrite="):
    save_context(tmp_path / "a", context, overwrite="yes")
  # JSON would give back a list for the tuple, "7" for the key, and has no NaN.
  for metadata, message in (
    (
      {"stop_ids": (2, 3)},
      r"would not read back as saved: JSON reads it as \{'stop_ids': \[2, 3\]",
    ),
    ({7: "layer seven"}, r"would not read back as saved: JSON reads it as \{'7'"),
    ({"score": float("nan")}, "metadata must be JSON-serialisable: Out of range float"),
  ):
    with pytest.raises(ValueError, match=message):
      save_context(tmp_path / "a", context, metadata=metadata)
  template = _template(KIVI)
  with pytest.raises(ValueError, match="context holds a ShapeDtypeStruct at leaf 0, not an array"):
    save_context(tmp_path / "a", template)
  assert not (tmp_path / "a").exists()
  with pytest.raises(FileNotFoundError, match="holds no saved context"):
    restore_context(tmp_path / "a", _template(KIVI))
  with pytest.raises(ValueError, match="template must be a kvjax.compressed_context"):
    restore_context(tmp_path / "a", context.caches)
  for call in (lambda: save_context(None, context), lambda: restore_context(None, template)):
    with pytest.raises(ValueError, match="directory must be a path .* got NoneType"):
      call()
  with pytest.raises(TypeError, match="cannot save a object"):
    describe_structure({"x": object()})


def test_another_format_is_refused(tmp_path):
  save_context(tmp_path / "context", _context(KIVI))
  path = tmp_path / "context" / METADATA_FILE
  record = json.loads(path.read_text())
  path.write_text(json.dumps(dict(record, format="kvjax-context/0")))
  with pytest.raises(ValueError, match="this kvjax reads 'kvjax-context/1'"):
    restore_context(tmp_path / "context", _template(KIVI))


@pytest.mark.parametrize(
  "spec, layer_loop",
  # GEAR's and a selection's under -m slow: the same re-laying as a TPU's layout, whose test
  # takes a scanned GEAR cache in the default run.
  [(KIVI, "unroll")]
  + [
    pytest.param(spec, layer_loop, marks=pytest.mark.slow)
    for spec in (
      KIVI,
      "gear:bits=2,group_size=16,block=16,rank=2",
      f"snapkv:budget=24,window=8+{KIVI}",
    )
    for layer_loop in ("unroll", "scan")
    if (spec, layer_loop) != (KIVI, "unroll")
  ],
)
def test_a_kivi_context_saved_before_v27_restores_into_a_template_made_now(
  spec, layer_loop, tmp_path
):
  """Before v27 a KIVI/GEAR cache whose capacity (40 + 8, or 24 + 8) is a multiple of its
  block had one block more in its segment: what a cache asked for one token more has now."""
  decoder, params = tiny_decoder(layer_loop=layer_loop)
  saved = _context(spec, layer_loop, room=ROOM + 1)
  template = _template(spec, layer_loop)
  assert describe_structure(saved) != describe_structure(template)
  save_context(tmp_path / "context", saved)
  restored = restore_context(tmp_path / "context", template)
  # Restored in the template's layout: the saved arrays less the block past every row's tokens.
  assert_held_in_template_layout(restored, saved, template)
  ask = lambda ctx: continue_context(decoder, params, ctx, QUESTIONS, max_new_tokens=4)
  np.testing.assert_array_equal(ask(restored)[0], ask(saved)[0])
  # Any other difference is still refused.
  with pytest.raises(ValueError, match="does not fit the template"):
    restore_context(tmp_path / "context", _template(spec, layer_loop, room=ROOM + 32))


def assert_held_in_template_layout(restored, saved, template):
  """`restored` has the template's structure and holds `saved`'s arrays, cut to the template's
  shapes or padded with zeros."""
  assert jax.tree.structure(restored) == jax.tree.structure(template)
  for held, was, wanted in zip(
    jax.tree.leaves(restored), jax.tree.leaves(saved), jax.tree.leaves(template), strict=True
  ):
    assert (held.shape, held.dtype) == (wanted.shape, wanted.dtype)
    common = tuple(slice(0, min(a, b)) for a, b in zip(held.shape, was.shape))
    np.testing.assert_array_equal(np.asarray(held)[common], np.asarray(was)[common])
    padding = np.ones(held.shape, bool)
    padding[common] = False
    assert not np.asarray(held)[padding].any()


def _decoder_and_context_makers(spec, layer_loop, head_dim):
  config = dataclasses.replace(TINY_CONFIG, head_dim=head_dim)
  decoder, params = tiny_decoder(config=config, layer_loop=layer_loop)
  method = lambda: parse_method_spec(spec)
  context = lambda room=ROOM, prompts=PROMPTS: compress_context(
    decoder, params, prompts, cache_method=method(), room=room
  )
  template = lambda room=ROOM: context_template(
    decoder, params, batch=2, prompt_len=40, cache_method=method(), room=room
  )
  return decoder, params, context, template


def _segment_rows_and_slots(context) -> list[tuple[int, int | None]]:
  """(token rows, GEAR outlier slots or None) of each KIVI/GEAR segment, and (capacity, None)
  of each dense cache, in flattening order."""
  is_laid_out = lambda node: isinstance(node, (KiviLayerCache, DenseLayerCache))
  leaves = jax.tree.leaves(context.caches, is_leaf=is_laid_out)
  axis = lambda keys: keys.ndim - 2  # the token axis, past a run's layer axis

  def layout(cache):
    if isinstance(cache, DenseLayerCache):
      return cache.keys.shape[axis(cache.keys)], None
    slots = cache.segment.outliers and cache.segment.outliers[0].shape[-1]
    return cache.segment.k_codes.shape[axis(cache.window_keys)], slots

  return [layout(cache) for cache in leaves if is_laid_out(cache)]


@pytest.mark.parametrize(
  "spec, layer_loop, head_dim, cpu_layout, tpu_layout",
  [
    # GEAR: 3 outliers a side in whole 128-lane tiles, 8-row tiles of blocks of 16 (128 rows).
    ("gear:bits=2,group_size=16,block=16,rank=2", "scan", 16, [(32, 6)], [(128, 128)]),
    # The full cache: its capacity (40 + 8 tokens) in whole 128-token tiles below 128 channels.
    ("full", "unroll", 16, [(48, None)] * 2, [(128, None)] * 2),
    # The next two under -m slow (the refusal below re-lays KIVI's rows in the default run):
    # KIVI at head_dim 128: whole tiles of 16 bfloat16 key-statistic rows of group 16 (256 rows).
    pytest.param(KIVI, "unroll", 128, [(32, None)] * 2, [(256, None)] * 2, marks=pytest.mark.slow),
    # A selection's survivors in GEAR storage (24 + 8 tokens: 16 rows, rounded to 128).
    pytest.param(
      "snapkv:budget=24,window=8+gear:bits=4,group_size=16,block=16,rank=2",
      "unroll",
      16,
      [(16, 6)] * 2,
      [(128, 128)] * 2,
      marks=pytest.mark.slow,
    ),
  ],
  ids=["scan-gear", "full", "kivi-d128", "snapkv+gear"],
)
def test_a_context_laid_out_for_a_tpu_restores_elsewhere_and_back(
  spec, layer_loop, head_dim, cpu_layout, tpu_layout, laid_out_for_a_tpu, tmp_path
):
  """A KIVI/GEAR segment where the compiled TPU kernel reads it holds whole tiles of rows and of
  GEAR's outlier slots (`KiviLayerCache.zeros`), a full cache whole tiles of tokens
  (`FullCache.allocate`). A context compressed there restores into a template made on another
  backend, and one compressed elsewhere into a TPU's template: the same arrays re-laid,
  answering the same tokens."""
  decoder, params, context, template = _decoder_and_context_makers(spec, layer_loop, head_dim)
  laid_out_for_a_tpu()
  on_tpu, tpu_template = context(), template()
  laid_out_for_a_tpu.undo()
  elsewhere, cpu_template = context(), template()
  assert _segment_rows_and_slots(on_tpu) == tpu_layout
  assert _segment_rows_and_slots(elsewhere) == cpu_layout
  ask = lambda ctx: continue_context(decoder, params, ctx, QUESTIONS, max_new_tokens=4)[0]
  answers = ask(elsewhere)
  np.testing.assert_array_equal(ask(on_tpu), answers)

  save_context(tmp_path / "tpu", on_tpu)
  restored = restore_context(tmp_path / "tpu", cpu_template)
  assert_same_arrays(restored, elsewhere)
  assert_same_arrays(restore_context(tmp_path / "tpu", elsewhere), elsewhere)  # arrays as template
  np.testing.assert_array_equal(ask(restored), answers)

  save_context(tmp_path / "cpu", elsewhere)
  restored = restore_context(tmp_path / "cpu", tpu_template)
  assert_same_arrays(restored, on_tpu)
  np.testing.assert_array_equal(ask(restored), answers)
  # Another room is still refused, on either side (a TPU's segment, rounded up, could have been
  # made for any room it rounds up from: one past it).
  laid_out_for_a_tpu()
  with pytest.raises(ValueError, match="does not fit the template"):
    restore_context(tmp_path / "cpu", template(room=ROOM + 600))
  laid_out_for_a_tpu.undo()
  with pytest.raises(ValueError, match="does not fit the template"):
    restore_context(tmp_path / "tpu", template(room=ROOM + 600))


@pytest.mark.parametrize(
  "spec, head_dim, held",
  [
    (KIVI, 128, "64 quantized tokens in a row of a layer cache whose segment has 32 in the "),
    # Below 128 channels a TPU's full cache holds whole 128-token tiles (70 of them used).
    ("full", 16, "70 tokens in a row of a layer cache of 48 in the "),
  ],
)
def test_a_context_holding_more_than_the_templates_segment_is_refused(
  spec, head_dim, held, laid_out_for_a_tpu, tmp_path
):
  """A TPU's rounded segment (full cache) has room past what was asked (256 rows for 32; 128
  slots for 48): a context that uses it (prompts of 70 and 61 tokens; 64 and 48 of them
  quantized) has every shape of a template made elsewhere for prompts of 40 but its segment's
  (capacity), which is too short for them: it is refused, saying how much more room the
  template needs."""
  decoder, params, context, template = _decoder_and_context_makers(spec, "unroll", head_dim)
  rng = np.random.default_rng(2)
  laid_out_for_a_tpu()
  longer = context(prompts=[list(rng.integers(1, 64, 70)), list(rng.integers(1, 64, 61))])
  laid_out_for_a_tpu.undo()
  save_context(tmp_path / "context", longer)
  more = int(held.split()[0]) - int(held.split()[-3])
  match = f"holds {held}template: make the template with at least {more} tokens more room"
  with pytest.raises(ValueError, match=match):
    restore_context(tmp_path / "context", template())
  # (8 more for the questions' tokens, which a full cache holds from its own room)
  restored = restore_context(tmp_path / "context", template(room=ROOM + more + 8))
  ask = lambda ctx: continue_context(decoder, params, ctx, QUESTIONS, max_new_tokens=4)[0]
  np.testing.assert_array_equal(ask(restored), ask(longer))


def test_a_context_laid_out_elsewhere_is_refused_naming_what_really_differs(
  laid_out_for_a_tpu, tmp_path
):
  """Where a saved segment's layout differs from the template's and something else differs too,
  the refusal names that (a layout alone restores): the statistics' dtype, not the TPU's 256
  rows against 32; KIVI's window, not an error about rows that are not whole blocks of it."""
  decoder, params, context, _ = _decoder_and_context_makers(KIVI, "unroll", 128)
  template = lambda spec=KIVI, **dtype: context_template(
    decoder, params, batch=2, prompt_len=40, cache_method=parse_method_spec(spec), room=ROOM,
    **dtype,
  )  # fmt: skip
  laid_out_for_a_tpu()
  save_context(tmp_path / "tpu", context())
  laid_out_for_a_tpu.undo()
  assert _segment_rows_and_slots(template()) == [(32, None)] * 2
  dtype = r"at context\.caches\[0\]\.segment\.k_scale\.dtype it holds 'bfloat16', the template"
  with pytest.raises(ValueError, match=dtype):
    restore_context(tmp_path / "tpu", template(cache_dtype=jnp.float32))
  save_context(tmp_path / "cpu", context())
  laid_out_for_a_tpu()
  wider_window = template(KIVI.replace("residual=16", "residual=32"))
  assert _segment_rows_and_slots(wider_window) == [(256, None)] * 2
  codec = r"at context\.caches\[0\]\.settings\.codec it holds 'KiviCodec\(bits=2, group_size=16, "
  with pytest.raises(ValueError, match=codec + r"window=16\)'"):
    restore_context(tmp_path / "cpu", wider_window)
  # A full cache: 128 slots on the TPU against 48, and its dtype.
  decoder, params, context, _ = _decoder_and_context_makers("full", "unroll", 16)
  save_context(tmp_path / "full", context())
  laid_out_for_a_tpu.undo()
  float32_template = context_template(
    decoder, params, batch=2, prompt_len=40, cache_method=parse_method_spec("full"), room=ROOM,
    cache_dtype=jnp.float32,
  )  # fmt: skip
  with pytest.raises(ValueError, match=r"at context\.caches\[0\]\.keys\.dtype it holds 'bfloat16'"):
    restore_context(tmp_path / "full", float32_template)


def test_a_gear_context_laid_out_on_a_tpu_by_v64_restores_elsewhere(monkeypatch, tmp_path):
  """v64 rounded a TPU's GEAR segment to whole tiles of key statistics alone and stored its
  outliers unpadded (v65 added whole tiles of GEAR blocks and of outlier slots): at group 16,
  blocks of 64 and head_dim 128, 256 rows where a TPU's now hold 512 and a CPU's 128. Such a
  save restores into a CPU template as the context compressed there."""
  from kvjax import attention_dispatch
  from pallas_kernels import quantized_decode_attention_tpu

  spec = "gear:bits=2,group_size=16,block=64,rank=2"
  decoder, params = tiny_decoder(config=dataclasses.replace(TINY_CONFIG, head_dim=128))
  rng = np.random.default_rng(3)
  prompts = [list(rng.integers(1, 64, 140)), list(rng.integers(1, 64, 131))]
  context = lambda: compress_context(
    decoder, params, prompts, cache_method=parse_method_spec(spec), room=ROOM
  )
  v64_granule = lambda implementation, head_dim, group_size, stats_dtype, *_, **__: (
    quantized_decode_attention_tpu.segment_token_granule(head_dim, group_size, stats_dtype)
  )
  with monkeypatch.context() as patch:
    patch.setattr(attention_dispatch, "quantized_segment_granule", v64_granule)
    jax.clear_caches()
    save_context(tmp_path / "v64", context())
  jax.clear_caches()
  elsewhere = context()
  assert _segment_rows_and_slots(elsewhere) == [(128, 164)] * 2
  template = context_template(
    decoder, params, batch=2, prompt_len=140, cache_method=parse_method_spec(spec), room=ROOM
  )
  restored = restore_context(tmp_path / "v64", template)
  assert_same_arrays(restored, elsewhere)


def test_a_gear_codec_is_described_as_before_its_outlier_slots(tmp_path):
  """What kvjax v64 wrote for this codec, before GEAR's stored outlier slots (v65) existed: the
  slots are layout, told by the arrays, so a context saved then restores into a template now."""
  spec = "gear:bits=2,group_size=16,block=16,rank=2"
  context = _context(spec)
  save_context(tmp_path / "context", context)
  cache = read_context_record(tmp_path / "context")["structure"]["children"]["caches"][0]
  assert cache["settings"]["codec"] == (
    "GearCodec(bits=2, group_size=16, window=16, rank=2, outliers_per_side=3, iterations=3)"
  )
  assert_same_arrays(restore_context(tmp_path / "context", _template(spec)), context)
