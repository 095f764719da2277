"""Saving a compressed context to disk and restoring it (orbax-checkpoint).

What is written is what the caches hold: a KIVI-2 cache's packed codes, scales, minimums and
full-precision window, a SnapKV cache's kept tokens, never dequantized or dropped K/V. A saved
directory holds `arrays/` (an orbax checkpoint of the context's non-empty arrays) and
`kvjax_context.json` (written last, so its presence marks a complete save): the context's
structure, every array's shape and dtype, the cache bytes, and the caller's metadata.

A cache's configuration (method, bits, group size, budgets, retained heads) is static pytree
metadata, which orbax does not store. So a context is restored into a template of the same
structure (`kvjax.compressed_context.context_template`, or any context of the same method and
shapes), and the saved structure is compared with the template's before any array is read: a
template of another method or configuration is a `ValueError` naming the first difference,
never arrays read into a cache that would misread them. How a cache runs (`implementation`,
`kernel_settings`) is not part of what it stores: the template's apply, so a context saved on
one machine runs with the kernels of another. Where that changes how a cache is laid out (a
TPU's KIVI/GEAR segment holds whole tiles of rows, its GEAR blocks whole lane tiles of outlier
slots: `KiviLayerCache.zeros`; a TPU's `full` cache whole tiles of tokens: `FullCache.allocate`),
or an older kvjax laid it out otherwise (before v27, one block more for a capacity of whole
blocks), the saved cache is read as it was saved and then re-laid into the template's (rows past
every row's tokens and padding slots cut off, or zeros added), so a context compressed on a TPU
restores on a GPU or a CPU, and back. (Selections keep their tokens in storage laid out alike
everywhere.)
"""

import dataclasses
import json
import os
import pathlib
import shutil
import uuid
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.compressed_context import CompressedContext, is_shared
from kvjax.dense_cache import DenseLayerCache
from kvjax.kivi_cache import KiviLayerCache
from kvjax.layer_runs import StackedLayerCaches

FORMAT = "kvjax-context/1"
METADATA_FILE = "kvjax_context.json"
ARRAYS_DIR = "arrays"
# Static fields that choose how a cache computes, not what its arrays mean; the prompt width a
# cache was allocated for, which only `ingest` reads (a saved context is past its prompt); and a
# selection's scratch layout for chunked prefill, which its codec storage's arrays tell (saves
# from 2026-11-24 until v66 describe it, earlier ones lack it: either way the template's applies).
RUN_SETTINGS = ("implementation", "kernel_settings", "allocated_prompt_len", "scratch_layout")
# Static fields added to caches after FORMAT was fixed, with the value (its repr) that gives the
# behaviour contexts saved before them had: a saved description without one reads as this.
SETTINGS_ADDED_LATER = {"evicts_when_full": "True", "rope_scaling": "None"}


def _is_array(node) -> bool:
  return isinstance(node, (jax.Array, np.ndarray, jax.ShapeDtypeStruct))


def describe_structure(node) -> Any:
  """A JSON-able description of a pytree of kvjax caches: per node its type and static
  settings (less RUN_SETTINGS), per array its shape and dtype. Equal descriptions flatten to
  the same leaves in the same order."""
  if node is None:
    return None
  if _is_array(node):
    return {"shape": list(node.shape), "dtype": np.dtype(node.dtype).name}
  if isinstance(node, (tuple, list)):
    return [describe_structure(child) for child in node]
  if isinstance(node, dict):
    return {str(key): describe_structure(node[key]) for key in sorted(node)}
  if dataclasses.is_dataclass(node) and not isinstance(node, type):
    settings, children = {}, {}
    for field in dataclasses.fields(node):
      value = getattr(node, field.name)
      static = field.metadata.get("static", False) or not field.metadata.get("pytree_node", True)
      if not static:
        children[field.name] = describe_structure(value)
      elif field.name not in RUN_SETTINGS:
        settings[field.name] = repr(value)
    return {"type": type(node).__qualname__, "settings": settings, "children": children}
  raise TypeError(
    f"cannot save a {type(node).__qualname__} in a context: contexts hold kvjax caches "
    "(dataclass pytrees), tuples, lists, dicts and arrays"
  )


def _as_described_now(structure, template):
  """`structure` (as saved) as kvjax describes it now: with the SETTINGS_ADDED_LATER its nodes
  lack and the template's nodes have, at their old-behaviour values, without the RUN_SETTINGS
  an older kvjax described, and with the children its nodes lack where the template's hold
  None (a field added later that holds no array, such as a selection's chunked-prefill scratch
  of 2026-11-24: the save predates it, and held nothing there)."""
  if isinstance(structure, list) and isinstance(template, list) and len(structure) == len(template):
    return [_as_described_now(a, b) for a, b in zip(structure, template)]
  if not (isinstance(structure, dict) and isinstance(template, dict)):
    return structure
  completed = {key: _as_described_now(value, template.get(key)) for key, value in structure.items()}
  settings, wanted = structure.get("settings"), template.get("settings")
  if isinstance(settings, dict) and isinstance(wanted, dict):
    added = {
      name: value
      for name, value in SETTINGS_ADDED_LATER.items()
      if name in wanted and name not in settings
    }
    kept = {name: value for name, value in settings.items() if name not in RUN_SETTINGS}
    completed["settings"] = {**kept, **added}
  children, wanted = structure.get("children"), template.get("children")
  if isinstance(children, dict) and isinstance(wanted, dict):
    empty = {name: None for name, child in wanted.items() if child is None and name not in children}
    completed["children"] = {**completed["children"], **empty}
  return completed


def _differences(saved, template, path: str = "context"):
  """(where, saved, template's) for each place the described structures differ, in order."""
  if type(saved) is not type(template):
    yield path, saved, template
  elif isinstance(saved, list):
    if len(saved) != len(template):
      yield f"{path} (length)", len(saved), len(template)
    else:
      for index, (a, b) in enumerate(zip(saved, template)):
        yield from _differences(a, b, f"{path}[{index}]")
  elif isinstance(saved, dict):
    if sorted(saved) != sorted(template):
      yield f"{path} (keys)", sorted(saved), sorted(template)
    else:
      for key in saved:
        # A node's arrays are named by field alone: caches[0].storage, not .children.storage.
        child_path = path if key == "children" else f"{path}.{key}"
        yield from _differences(saved[key], template[key], child_path)
  elif saved != template:
    yield path, saved, template


def _first_difference(saved, template) -> tuple[str, Any, Any] | None:
  return next(_differences(saved, template), None)


def _difference_to_name(saved, template) -> tuple[str, Any, Any] | None:
  """The first difference, or where a cache's shape differs first (a layout that restoring may
  accept: a KIVI/GEAR segment's, a dense cache's K/V), the first that is not such a shape: a
  dtype or a codec that differs too is what makes the context not fit."""
  differences = list(_differences(saved, template))
  layout_like = lambda where: (
    ".shape[" in where
    and (".segment." in where or ".keys.shape[" in where or ".values.shape[" in where)
  )
  return next((d for d in differences if not layout_like(d[0])), differences[0])


def _holds_stacked_layers(structure) -> bool:
  """Whether a described context holds layers stacked into runs (a scanned layer loop)."""
  if isinstance(structure, list):
    return any(_holds_stacked_layers(child) for child in structure)
  if isinstance(structure, dict):
    if structure.get("type") == StackedLayerCaches.__qualname__:
      return True
    return any(_holds_stacked_layers(child) for child in structure.values())
  return False


def _disk_bytes(directory: pathlib.Path) -> int:
  return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())


def _leaf_key(index: int) -> str:
  return f"leaf_{index:05d}"


def save_context(
  directory: str | pathlib.Path,
  context: CompressedContext,
  *,
  metadata: dict | None = None,
  overwrite: bool = False,
) -> int:
  """Writes `context` to a new `directory` and returns the bytes written to disk.

  `metadata`: anything JSON-serialisable to keep beside it (the method spec, the document's
  name, the model). `overwrite=True` replaces a directory only if it holds a saved context.
  """
  import orbax.checkpoint as ocp  # imported here: orbax and tensorstore take a while to load

  check_directory(directory)

  if not isinstance(context, CompressedContext):
    raise ValueError(
      f"context must be a kvjax.compressed_context.CompressedContext, got "
      f"{type(context).__qualname__}"
    )
  if is_shared(context):
    raise ValueError(
      "save_context: the context is shared (share_context); save the context it was shared "
      "from, and share it again after restore_context"
    )
  if not isinstance(overwrite, bool):
    raise ValueError(f"overwrite={overwrite!r} must be True or False")
  metadata = {} if metadata is None else metadata
  try:
    metadata_text = json.dumps(metadata, allow_nan=False)
  except (TypeError, ValueError) as error:
    raise ValueError(f"metadata must be JSON-serialisable: {error}") from None
  read_back = json.loads(metadata_text)
  if read_back != metadata:
    # JSON would hand back something else (a tuple as a list, an int key as a string).
    raise ValueError(
      f"metadata {metadata!r} would not read back as saved: JSON reads it as "
      f"{read_back!r}; use lists, string keys, str/int/float/bool/None"
    )
  leaves = jax.tree_util.tree_leaves(context)
  for index, leaf in enumerate(leaves):
    if not isinstance(leaf, (jax.Array, np.ndarray)) or isinstance(leaf, jax.core.Tracer):
      raise ValueError(
        f"context holds a {type(leaf).__name__} at leaf {index}, not an array: save a context "
        "made by compress_context (a context_template holds shapes only), outside jit"
      )
  directory = pathlib.Path(directory)
  if directory.is_symlink():
    # A link to a saved context (a "current" one): the save replaces what it points to.
    directory = directory.resolve()
  if directory.exists():
    if not overwrite:
      raise FileExistsError(f"directory={str(directory)!r} exists; pass overwrite=True")
    if not (directory / METADATA_FILE).is_file():
      raise FileExistsError(
        f"directory={str(directory)!r} exists and holds no saved context ({METADATA_FILE}); "
        "overwrite only replaces a saved context"
      )

  # Orbax refuses zero-size arrays; they hold nothing, and restore rebuilds them from shapes.
  arrays = {_leaf_key(i): leaf for i, leaf in enumerate(leaves) if leaf.size}
  record = {
    "format": FORMAT,
    "structure": describe_structure(context),
    "cache_bytes": context.cache_bytes,
    "metadata": read_back,
  }
  # Written beside the directory and renamed into place: a save that fails (a full disk, an
  # interrupt) leaves a context saved there before as it was.
  directory.parent.mkdir(parents=True, exist_ok=True)
  # Names of their own (not the process id, which a container reuses): a save interrupted
  # before cleaning up must not block the next one.
  partial, replaced = (
    directory.parent / f".{directory.name}.{what}-{uuid.uuid4().hex}"
    for what in ("partial", "replaced")
  )
  try:
    partial.mkdir()
    # Closed explicitly rather than in a `with` block, which not every orbax version supports.
    checkpointer = ocp.StandardCheckpointer()
    try:
      checkpointer.save((partial / ARRAYS_DIR).absolute(), arrays)
      checkpointer.wait_until_finished()
    finally:
      checkpointer.close()
    (partial / METADATA_FILE).write_text(json.dumps(record, indent=1))
    if directory.exists():
      directory.rename(replaced)
    partial.rename(directory)
  finally:
    shutil.rmtree(partial, ignore_errors=True)
  shutil.rmtree(replaced, ignore_errors=True)
  return _disk_bytes(directory)


def check_directory(directory) -> None:
  """ValueError unless `directory` is a path (a str or an os.PathLike)."""
  if not isinstance(directory, (str, os.PathLike)):
    raise ValueError(
      f"directory must be a path (a str or a pathlib.Path), got {type(directory).__qualname__}"
    )


def read_context_record(directory: str | pathlib.Path) -> dict:
  """The saved record: format, structure, cache_bytes and the caller's metadata."""
  check_directory(directory)
  path = pathlib.Path(directory) / METADATA_FILE
  if not path.is_file():
    raise FileNotFoundError(
      f"directory={str(directory)!r} holds no saved context ({METADATA_FILE} missing: "
      "not saved by save_context, or the save did not finish)"
    )
  record = json.loads(path.read_text())
  if record.get("format") != FORMAT:
    raise ValueError(f"{path} has format {record.get('format')!r}; this kvjax reads {FORMAT!r}")
  return record


def _is_laid_out_cache(node) -> bool:
  """Whether `node` is a cache whose layout a backend decides: a KIVI/GEAR cache (its segment's
  rows, GEAR's outlier slots) or a dense one (its capacity: `FullCache.allocate`)."""
  return isinstance(node, KiviLayerCache) or type(node) is DenseLayerCache


def _laid_out_caches(caches) -> list[KiviLayerCache | DenseLayerCache]:
  """The caches in `caches` whose layout a backend decides, in flattening order (a scanned run's
  with a leading layer axis on every array)."""
  leaves = jax.tree.leaves(caches, is_leaf=_is_laid_out_cache)
  return [node for node in leaves if _is_laid_out_cache(node)]


def _with_laid_out_caches(caches, replacements: list):
  """`caches` with its `_laid_out_caches`, in flattening order, replaced."""
  replacing = iter(replacements)
  return jax.tree.map(
    lambda node: next(replacing) if _is_laid_out_cache(node) else node,
    caches,
    is_leaf=_is_laid_out_cache,
  )


def _is_stacked(cache: KiviLayerCache | DenseLayerCache) -> bool:
  """Whether `cache` is a run of layers, stacked on a leading axis of every array."""
  keys = cache.window_keys if isinstance(cache, KiviLayerCache) else cache.keys
  return keys.ndim == 5


def _one_layer(cache):
  """A layer's cache (its shapes, for a stacked run's)."""
  return StackedLayerCaches(cache).layer_template() if _is_stacked(cache) else cache


def _relaid(cache, tokens: int, codec=None, shapes_only: bool = False):
  """`KiviLayerCache.with_segment_layout(tokens, codec)` or `DenseLayerCache.with_capacity(tokens)`,
  layer by layer for a stacked run; its shapes only with `shapes_only` (a template, of arrays or
  of shapes)."""
  if isinstance(cache, KiviLayerCache):
    relay = lambda layer: layer.with_segment_layout(tokens, codec)
  else:
    relay = lambda layer: layer.with_capacity(tokens)
  if _is_stacked(cache):
    relay = jax.vmap(relay)
  return jax.eval_shape(relay, cache) if shapes_only else relay(cache)


def _described_nodes(structure, types: set[str]) -> list[dict]:
  """The described nodes of `types` in `structure`, in the order `describe_structure` wrote
  them (the flattening order)."""
  if isinstance(structure, list):
    return [found for child in structure for found in _described_nodes(child, types)]
  if not isinstance(structure, dict):
    return []
  if structure.get("type") in types:
    return [structure]
  return [found for child in structure.values() for found in _described_nodes(child, types)]


def _described_layout(described: dict, layer_axes: int) -> tuple[int, int | None] | None:
  """(token rows, GEAR outlier slots or None) of a described KIVI/GEAR segment, or (capacity,
  None) of a described dense cache."""
  try:
    children = described["children"]
    if "keys" in children:
      return children["keys"]["shape"][2 + layer_axes], None
    segment = children["segment"]["children"]
    outliers = segment["outliers"]
    slots = None if outliers is None else outliers[0]["shape"][-1]
    return segment["k_codes"]["shape"][2 + layer_axes], slots
  except (KeyError, IndexError, TypeError):
    return None


def _made_for_the_same_capacity(layer: KiviLayerCache, saved_tokens: int) -> bool:
  """Whether a saved segment of `saved_tokens` rows and the template `layer`'s segment were
  made for the same capacity, either laid out for the compiled TPU kernel (rounded up to whole
  tiles: `segment_tokens_on_tpu`, or as v64 rounded GEAR's, before its whole outlier blocks), or
  the saved one before v27 (one block more for a capacity of whole blocks). A TPU's segment
  could have been made for any capacity that rounds up to it: the template's is taken."""
  tokens, window = layer.quantized_capacity, layer.window
  as_v64 = lambda held: layer.segment_tokens_on_tpu(held, whole_outlier_blocks=False)
  return any(
    saved_tokens in (tokens, on_tpu(tokens), tokens + window)
    or tokens == on_tpu(saved_tokens)
    or (saved_tokens >= window and tokens == on_tpu(saved_tokens - window))
    for on_tpu in (layer.segment_tokens_on_tpu, as_v64)
  )


def _made_for_the_same_room(layer: DenseLayerCache, saved_tokens: int) -> bool:
  """Whether a saved dense cache of `saved_tokens` slots and the template `layer` were made for
  the same capacity, one of them rounded up for the compiled TPU kernel (`capacity_on_tpu`)."""
  tokens, on_tpu = layer.capacity, layer.capacity_on_tpu
  return saved_tokens in (tokens, on_tpu(tokens)) or tokens == on_tpu(saved_tokens)


def _template_in_saved_layout(template: CompressedContext, saved) -> CompressedContext | None:
  """`template` with every KIVI/GEAR segment (its token rows, GEAR's outlier slots) and dense
  cache (its capacity) laid out as the `saved` description's, where each was made for the
  template's room and outliers on another backend or by an older kvjax; None where one was
  not."""
  caches = _laid_out_caches(template.caches)
  described = _described_nodes(saved, {type(cache).__qualname__ for cache in caches})
  if not caches or len(described) != len(caches):
    return None
  laid = []
  for cache, description in zip(caches, described):
    layout = _described_layout(description, int(_is_stacked(cache)))
    if layout is None:
      return None
    tokens, slots = layout
    layer = _one_layer(cache)
    if isinstance(cache, DenseLayerCache):
      if not _made_for_the_same_room(layer, tokens):
        return None
      laid.append(_relaid(cache, tokens, shapes_only=True))
      continue
    codec = cache.codec
    if (slots is None) != (cache.segment.outliers is None):
      return None
    if slots is not None:
      if slots < codec.outlier_count:
        return None
      codec = dataclasses.replace(codec, outlier_slots=slots)
    if tokens % layer.window or not _made_for_the_same_capacity(layer, tokens):
      return None
    laid.append(_relaid(cache, tokens, codec, shapes_only=True))
  return dataclasses.replace(template, caches=_with_laid_out_caches(template.caches, laid))


def _in_template_layout(
  restored: CompressedContext, template: CompressedContext, directory
) -> CompressedContext:
  """`restored`'s KIVI/GEAR segments and dense caches laid out as `template`'s: refused where a
  row holds more (quantized) tokens than the template's segment (dense cache) has rows."""
  laid = []
  for held, wanted in zip(_laid_out_caches(restored.caches), _laid_out_caches(template.caches)):
    if isinstance(wanted, DenseLayerCache):
      rows, lengths = _one_layer(wanted).capacity, held.lengths
      what, where = "tokens", "a layer cache of"
    else:
      rows, lengths = _one_layer(wanted).quantized_capacity, held.quantized_lengths
      what, where = "quantized tokens", "a layer cache whose segment has"
    most = int(np.max(np.asarray(lengths)))
    if most > rows:
      raise ValueError(
        f"the context in {str(directory)!r} holds {most} {what} in a row of {where} {rows} in "
        f"the template: make the template with at least {most - rows} tokens more room"
      )
    codec = getattr(wanted, "codec", None)
    laid.append(_relaid(held, rows, codec))
  return dataclasses.replace(restored, caches=_with_laid_out_caches(restored.caches, laid))


def restore_context(
  directory: str | pathlib.Path, template: CompressedContext
) -> CompressedContext:
  """The context saved in `directory`, restored into `template`'s structure (its arrays or
  `jax.ShapeDtypeStruct`s give shapes and dtypes, and shardings where they carry one; others
  land on the default device)."""
  import orbax.checkpoint as ocp  # imported here: orbax and tensorstore take a while to load

  if not isinstance(template, CompressedContext):
    raise ValueError(
      f"template must be a kvjax.compressed_context.CompressedContext (context_template "
      f"makes one), got {type(template).__qualname__}"
    )
  record = read_context_record(directory)
  structure = describe_structure(template)
  saved = _as_described_now(record["structure"], structure)
  difference = _first_difference(saved, structure)
  read_into = template
  if difference:
    in_saved_layout = _template_in_saved_layout(template, saved)
    if in_saved_layout is not None:
      # The segments' layouts differ as restoring allows: what else differs is what to name.
      difference = _first_difference(saved, describe_structure(in_saved_layout))
      if difference is None:
        read_into = in_saved_layout
  if difference:
    where, saved, wanted = _difference_to_name(saved, structure)
    hint = "restore with a template of the method, model and shapes it was saved with"
    saved_scanned, template_scanned = (
      _holds_stacked_layers(record["structure"]),
      _holds_stacked_layers(structure),
    )
    if saved_scanned != template_scanned:
      loops = {True: "layer_loop='scan'", False: "layer_loop='unroll'"}
      hint = (
        f"it was saved from a decoder with {loops[saved_scanned]} and the template comes from "
        f"one with {loops[template_scanned]}: make the template with the saving decoder's "
        "layer loop"
      )
    raise ValueError(
      f"the context in {str(directory)!r} does not fit the template: at {where} it holds "
      f"{saved!r}, the template has {wanted!r} ({hint})"
    )

  default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  shardings = [getattr(leaf, "sharding", None) or default for leaf in jax.tree.leaves(template)]
  # A segment read in the saved layout lands where the template's would (its rows' sharding).
  leaves, treedef = jax.tree_util.tree_flatten(read_into)

  def target(index):
    return jax.ShapeDtypeStruct(leaves[index].shape, leaves[index].dtype, sharding=shardings[index])

  targets = {_leaf_key(i): target(i) for i, leaf in enumerate(leaves) if leaf.size}
  checkpointer = ocp.StandardCheckpointer()
  try:
    arrays = checkpointer.restore((pathlib.Path(directory) / ARRAYS_DIR).absolute(), targets)
  finally:
    checkpointer.close()
  # Empty leaves (a KIVI segment with no room yet) hold nothing on disk; they are placed where
  # the template says, as the others are.
  restored = [
    arrays[_leaf_key(i)]
    if leaf.size
    else jax.device_put(jnp.zeros(leaf.shape, leaf.dtype), shardings[i])
    for i, leaf in enumerate(leaves)
  ]
  restored = jax.tree_util.tree_unflatten(treedef, restored)
  if read_into is template:
    return restored
  relaid = _in_template_layout(restored, template, directory)
  return jax.tree.unflatten(
    jax.tree.structure(template),
    [jax.device_put(leaf, sharding) for leaf, sharding in zip(jax.tree.leaves(relaid), shardings)],
  )
