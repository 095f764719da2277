"""Spreading a batch's rows over devices: where every array of a context keeps its rows.

Caches keep the batch at different axes (axis 0 in a layer's cache, axis 1 in the caches of
layers stacked for `lax.scan`), and some of their arrays have no batch axis at all. The batch
axis of each array is found by building the structure for two batch sizes with
`jax.eval_shape` (nothing is computed) and seeing which axis changed; that axis is split over
the devices the way `row_sharding` splits a `[batch]` array, and arrays without a batch axis are
replicated on its mesh.
"""

from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec


def check_row_sharding(row_sharding: Any, batch: int) -> None:
  """Refuses anything but a `NamedSharding` splitting one axis over mesh axes that divide
  `batch`."""
  if not isinstance(row_sharding, NamedSharding):
    raise ValueError(
      f"row_sharding must be a jax.sharding.NamedSharding splitting the batch axis, e.g. "
      f"NamedSharding(mesh, PartitionSpec('data')); got {type(row_sharding).__qualname__}"
    )
  spec = tuple(row_sharding.spec)
  if len(spec) != 1 or spec[0] is None:
    raise ValueError(
      f"row_sharding's spec must name the mesh axes of the batch axis alone, e.g. "
      f"PartitionSpec('data') or PartitionSpec(('data', 'model')); got {row_sharding.spec}"
    )
  names = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
  unknown = [name for name in names if name not in row_sharding.mesh.axis_names]
  if unknown:
    raise ValueError(
      f"row_sharding's spec must name mesh axes ({', '.join(row_sharding.mesh.axis_names)}) "
      f"for the batch axis; {unknown} are not among them (got {row_sharding.spec})"
    )
  axis_types = dict(zip(row_sharding.mesh.axis_names, row_sharding.mesh.axis_types, strict=True))
  explicit = [name for name in names if axis_types.get(name) != AxisType.Auto]
  if explicit:
    raise ValueError(
      f"row_sharding's mesh axes {explicit} are not of type Auto (jax.make_mesh makes Explicit "
      "axes by default); kvjax lets XLA propagate the rows' split, so build the mesh with "
      "jax.sharding.Mesh(devices, ('data',)) or jax.make_mesh(..., "
      "axis_types=(jax.sharding.AxisType.Auto,))"
    )
  devices = row_device_count(row_sharding)
  if batch % devices:
    raise ValueError(
      f"batch={batch} rows cannot be split evenly over row_sharding's {devices} devices "
      f"(mesh axes {names}); use a multiple of {devices} rows"
    )


def row_device_count(row_sharding: NamedSharding) -> int:
  """How many parts `row_sharding` (checked by `check_row_sharding`) splits the rows into."""
  axes = row_sharding.spec[0]
  names = axes if isinstance(axes, tuple) else (axes,)
  return int(np.prod([row_sharding.mesh.shape[name] for name in names]))


def _batch_axis(small: jax.ShapeDtypeStruct, large: jax.ShapeDtypeStruct, where: str) -> int | None:
  changed = [axis for axis, (a, b) in enumerate(zip(small.shape, large.shape)) if a != b]
  if len(small.shape) != len(large.shape) or len(changed) > 1:
    raise ValueError(
      f"{where}: shapes {small.shape} and {large.shape} for two batch sizes do not show one "
      "batch axis"
    )
  return changed[0] if changed else None


def row_shardings(shapes: Any, shapes_with_one_more_row: Any, row_sharding: NamedSharding) -> Any:
  """A `NamedSharding` per leaf of `shapes` (arrays or `jax.ShapeDtypeStruct`s, e.g. from
  `jax.eval_shape`): its batch axis, the one that grew in `shapes_with_one_more_row`, split as
  `row_sharding` splits rows, or replicated. Check `row_sharding` first (`check_row_sharding`)."""

  def sharding(path, leaf, grown_leaf):
    return rows_split_at(row_sharding, _batch_axis(leaf, grown_leaf, jax.tree_util.keystr(path)))

  return jax.tree_util.tree_map_with_path(sharding, shapes, shapes_with_one_more_row)


def rows_split_at(row_sharding: NamedSharding, axis: int | None) -> NamedSharding:
  """An array's batch axis `axis` split as `row_sharding` splits rows (None: replicated)."""
  if axis is None:
    return NamedSharding(row_sharding.mesh, PartitionSpec())
  return NamedSharding(row_sharding.mesh, PartitionSpec(*([None] * axis), row_sharding.spec[0]))
