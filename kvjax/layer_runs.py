"""Running a decoder's layers in order, with each cache operation compiled once per run of layers.

Unrolled, a 30-layer decoder traces and compiles its cache code 30 times, and a quantized
cache's code is large (block flushes, bit packing, GEAR's power iteration and outlier
selection): compiling SmolLM2's GEAR decode step took half a minute. Here a layer is
`before_cache` (its own weights: norm, projections, RoPE), then `cache_step` (the same code for
every layer: store K/V, attend), then `after_cache` (its own weights: output projection, MLP).
Consecutive layers whose caches have one pytree structure, shapes and dtypes form a run that
goes through one `lax.scan` over the stacked caches; inside it, `lax.switch` on the layer index
picks that layer's weight code. So the cache code is compiled once per run, each layer keeps
reading its own weight arrays, and nothing is copied out of a weight stack (scanning over
stacked weights would copy every layer's weights on every decode step: 1.6x slower decode on
a 2-core CPU). Layers whose caches differ (PyramidKV's per-layer budgets) run one by one.

A scanned run's caches can be returned still stacked (`StackedLayerCaches`, what a prefill
returns), so that the decode steps after it update each layer's slice in place instead of
stacking and unstacking every cache on every step.
"""

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from kvjax.cache_protocol import tree_nbytes

LAYER_LOOPS = ("scan", "unroll")


def check_layer_loop(layer_loop: str) -> None:
  if layer_loop not in LAYER_LOOPS:
    raise ValueError(f"layer_loop={layer_loop!r}; allowed: {', '.join(LAYER_LOOPS)}")


def pytree_signature(tree) -> tuple:
  """Hashable structure, shapes and dtypes of a pytree: equal signatures stack (and compile)
  alike."""
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  return treedef, tuple((jnp.shape(leaf), jnp.result_type(leaf)) for leaf in leaves)


def uniform_runs(signatures: Sequence[Any]) -> list[tuple[int, int]]:
  """[start, stop) ranges of consecutive equal signatures, in order, covering everything."""
  runs: list[tuple[int, int]] = []
  for index, signature in enumerate(signatures):
    if runs and signatures[runs[-1][0]] == signature:
      runs[-1] = (runs[-1][0], index + 1)
    else:
      runs.append((index, index + 1))
  return runs


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StackedLayerCaches:
  """The caches of consecutive look-alike layers, stacked on a new leading axis."""

  stacked: Any  # a layer cache whose every array has a leading [num_layers] axis

  @property
  def num_layers(self) -> int:
    return jax.tree_util.tree_leaves(self.stacked)[0].shape[0]

  def layer(self, index: int):
    """The cache of the run's `index`-th layer."""
    return jax.tree.map(lambda leaf: leaf[index], self.stacked)

  def layers(self) -> list:
    return [self.layer(i) for i in range(self.num_layers)]

  @property
  def nbytes(self) -> int:
    # Every layer cache's bytes are its arrays' bytes, so the stack's are the run's.
    return tree_nbytes(self.stacked)

  def layer_template(self):
    """The shapes of one layer's cache (works on a stack of shapes too: the stack goes in as an
    argument)."""
    return jax.eval_shape(lambda stacked: StackedLayerCaches(stacked).layer(0), self.stacked)

  @property
  def stored_elements(self) -> int:
    return self.num_layers * self.layer_template().stored_elements


def flatten_layer_caches(caches: Sequence[Any]) -> list:
  """One cache per layer, whether `caches` holds layer caches or stacked runs of them."""
  flat: list = []
  for item in caches:
    flat.extend(item.layers() if isinstance(item, StackedLayerCaches) else [item])
  return flat


def layer_cache_kinds(caches: Sequence[Any]) -> list[tuple[int, Any]]:
  """(first layer, cache) per item of `caches`: a layer cache as it is, a stacked run's stacked
  cache (each of its layers' class and static fields, its arrays with the layer axis first).
  For checks of a cache's kind, without slicing every array of a run layer by layer as
  `flatten_layer_caches` does."""
  kinds, layer = [], 0
  for item in caches:
    stacked = isinstance(item, StackedLayerCaches)
    kinds.append((layer, item.stacked if stacked else item))
    layer += item.num_layers if stacked else 1
  return kinds


def arrange_like(caches: Sequence[Any], template: Sequence[Any]) -> tuple:
  """`caches` (layer caches, or runs of them) in the arrangement of `template` (e.g. the shapes
  a decoder returns): stacked where the template has a `StackedLayerCaches`, loose elsewhere."""
  flat = iter(flatten_layer_caches(caches))
  arranged = []
  for item in template:
    if isinstance(item, StackedLayerCaches):
      arranged.append(StackedLayerCaches(_stack([next(flat) for _ in range(item.num_layers)])))
    else:
      arranged.append(next(flat))
  return tuple(arranged)


def _stack(trees):
  return jax.tree.map(lambda *leaves: jnp.stack(leaves), *trees)


def _segments(caches: Sequence[Any], layer_loop: str) -> list[tuple[int, int, Any]]:
  """(first layer, stop layer, a StackedLayerCaches or a list of layer caches) in order: runs
  already stacked stay whole; loose caches are grouped into runs of equal signature."""
  segments: list[tuple[int, int, Any]] = []
  loose: list = []
  layer = 0

  def flush():
    start = layer - len(loose)
    if layer_loop == "unroll":
      runs = [(i, i + 1) for i in range(len(loose))]
    else:
      runs = uniform_runs([pytree_signature(cache) for cache in loose])
    segments.extend((start + a, start + b, loose[a:b]) for a, b in runs)
    loose.clear()

  for item in caches:
    if isinstance(item, StackedLayerCaches):
      flush()
      segments.append((layer, layer + item.num_layers, item))
      layer += item.num_layers
    else:
      loose.append(item)
      layer += 1
  flush()
  return segments


def _written_back(stacked, read, new, write):
  """`stacked` with `write(leaf, new_leaf)` for each leaf the cache step changed: a leaf it
  returned as it was read (a shared context's frozen arrays) is left alone. Written back, it
  made the loop carrying the stack hold its own copy of that leaf, since the caller keeps the
  caches passed in: a shared context was held twice while `continue_context` ran."""
  read_leaves = jax.tree_util.tree_leaves(read)
  new_leaves, treedef = jax.tree_util.tree_flatten(new)
  stacked_leaves = treedef.flatten_up_to(stacked)
  return treedef.unflatten(
    leaf if fresh is old else write(leaf, fresh)
    for leaf, old, fresh in zip(stacked_leaves, read_leaves, new_leaves, strict=True)
  )


def run_layers(
  x: Any,
  caches: Sequence[Any],
  *,
  before_cache: Sequence[Callable[[Any], Any]],
  cache_step: Callable[[Any, Any], tuple[Any, Any]],
  after_cache: Sequence[Callable[[Any, Any], Any]],
  layer_loop: str = "scan",
  keep_stacked: bool = False,
) -> tuple[Any, tuple]:
  """For each layer i in order: `h = before_cache[i](x)`, `a, cache_i = cache_step(h,
  cache_i)`, `x = after_cache[i](x, a)`.

  `caches`: layer caches and/or `StackedLayerCaches` (which count for their number of
  layers). Returns (the last layer's `x`, the new caches): a stacked run comes back stacked;
  loose caches come back loose, unless `keep_stacked` returns their scanned runs stacked.
  `before_cache[i]` must return the same shapes for every layer, and so must `after_cache[i]`.
  `layer_loop="unroll"` calls every layer from Python (a stacked run too, layer by layer, and
  it comes back stacked); both loops give the same numbers.
  """
  check_layer_loop(layer_loop)
  segments = _segments(caches, layer_loop)
  num_layers = segments[-1][1] if segments else 0
  if not len(before_cache) == len(after_cache) == num_layers:
    raise ValueError(
      f"{len(before_cache)} before_cache and {len(after_cache)} after_cache functions for "
      f"caches of {num_layers} layers: one of each per layer"
    )
  new_caches: list = []
  for start, stop, segment in segments:
    if not isinstance(segment, StackedLayerCaches) and stop - start == 1:
      attended, cache = cache_step(before_cache[start](x), segment[0])
      x = after_cache[start](x, attended)
      new_caches.append(cache)
      continue
    if layer_loop == "unroll":  # a stacked run given to an unrolled loop comes back stacked
      stacked = segment.stacked
      for index in range(stop - start):
        # Read out before the write-back, as in the scan body: else XLA copies the whole stack
        # per layer to keep the update in place.
        layer_cache = jax.lax.optimization_barrier(StackedLayerCaches(stacked).layer(index))
        attended, cache = cache_step(before_cache[start + index](x), layer_cache)
        x = after_cache[start + index](x, attended)
        stacked = _written_back(
          stacked, layer_cache, cache, lambda leaf, new, i=index: leaf.at[i].set(new)
        )
      new_caches.append(StackedLayerCaches(stacked))
      continue
    stacked = segment.stacked if isinstance(segment, StackedLayerCaches) else _stack(segment)
    befores, afters = before_cache[start:stop], after_cache[start:stop]

    def body(carry, index, befores=befores, afters=afters):
      x, stacked = carry
      cache = jax.tree.map(
        lambda leaf: jax.lax.dynamic_index_in_dim(leaf, index, 0, False), stacked
      )
      # The layer's slice is read out before the stack is written back; without the barrier
      # XLA may read it late, and then copies the whole stack per layer to keep the update
      # in place (seen with float32 caches: 3x slower decode steps).
      read = jax.lax.optimization_barrier(cache)
      attended, cache = cache_step(jax.lax.switch(index, befores, x), read)
      # Written back into the carried stack: an in-place update of this layer's slice.
      stacked = _written_back(
        stacked,
        read,
        cache,
        lambda leaf, new: jax.lax.dynamic_update_index_in_dim(leaf, new, index, 0),
      )
      return (jax.lax.switch(index, afters, x, attended), stacked), None

    (x, stacked), _ = jax.lax.scan(body, (x, stacked), jnp.arange(stop - start, dtype=jnp.int32))
    run = StackedLayerCaches(stacked)
    if isinstance(segment, StackedLayerCaches) or keep_stacked:
      new_caches.append(run)
    else:
      new_caches.extend(run.layers())
  return x, tuple(new_caches)
