"""Whether contexts an older kvjax saved still restore: save every method of the test matrix at
an older commit, restore each at this one into a template made now, and compare it with a
context compressed now (tiny decoder, both layer loops, room 8).

`save` runs with the older commit's code, `restore` with this checkout's (the Python of this
repository's .venv for both):

```bash
git worktree add --detach /tmp/kvjax-old COMMIT
(cd /tmp/kvjax-old && PYTHONPATH=. JAX_PLATFORMS=cpu /path/to/kvjax/.venv/bin/python \
  /path/to/kvjax/scripts/saved_context_compat.py save /tmp/saved-COMMIT)
PYTHONPATH=. JAX_PLATFORMS=cpu .venv/bin/python scripts/saved_context_compat.py restore \
  /tmp/saved-COMMIT
```

`restore` prints one line per context that does not restore or holds other arrays, then a
tally, and exits 1 if any did not restore. The contexts under `tests/fixtures/saved_contexts/`
were saved this way (`tests/kvjax/test_context_checkpoint.py` restores them).
"""

import argparse
import collections
import inspect
import json
import pathlib
import sys

import jax
import numpy as np

ROOM = 8
INDEX = "index.json"


def _methods_and_loops(cases, tiny_decoder):
  """(spec, layer_loop) of every method of the matrix that needs no profile file, in each layer
  loop the tiny decoder of that commit takes."""
  takes_loop = "layer_loop" in inspect.signature(tiny_decoder).parameters
  for case in cases:
    spec = next(item for item in case if isinstance(item, str) and (":" in item or item == "full"))
    if "{" not in spec:  # razor and duo need a profile file written by a fixture
      yield from ((spec, loop) for loop in (("unroll", "scan") if takes_loop else (None,)))


def save(directory: pathlib.Path) -> None:
  from kvjax.compressed_context import compress_context
  from kvjax.context_checkpoint import save_context
  from kvjax.method_spec import parse_method_spec
  from tests.kvjax.test_method_matrix import CASES, PROMPTS
  from tests.kvjax.tiny_decoder import tiny_decoder

  directory.mkdir(parents=True, exist_ok=True)
  saved = []
  for spec, loop in _methods_and_loops(CASES, tiny_decoder):
    decoder, params = tiny_decoder(layer_loop=loop) if loop else tiny_decoder()
    method = parse_method_spec(spec)
    context = compress_context(decoder, params, PROMPTS, cache_method=method, room=ROOM)
    path = directory / str(len(saved))
    save_context(path, context)
    saved.append(dict(spec=spec, layer_loop=loop or "unroll", directory=path.name))
  (directory / INDEX).write_text(json.dumps(saved, indent=1))
  print(f"saved {len(saved)} contexts in {directory}")


def restore(directory: pathlib.Path) -> int:
  from kvjax.compressed_context import compress_context, context_template
  from kvjax.context_checkpoint import restore_context
  from kvjax.method_spec import parse_method_spec
  from tests.kvjax.test_method_matrix import PROMPTS
  from tests.kvjax.tiny_decoder import tiny_decoder

  tally = collections.Counter()
  for entry in json.loads((directory / INDEX).read_text()):
    decoder, params = tiny_decoder(layer_loop=entry["layer_loop"])
    method = parse_method_spec(entry["spec"])
    shape = dict(batch=len(PROMPTS), prompt_len=max(map(len, PROMPTS)), room=ROOM)
    template = context_template(decoder, params, cache_method=method, **shape)
    try:
      restored = restore_context(directory / entry["directory"], template)
    except ValueError as error:
      print(f"refused: {entry['spec']} ({entry['layer_loop']}): {error}")
      tally["refused"] += 1
      continue
    now = compress_context(decoder, params, PROMPTS, cache_method=method, room=ROOM)
    same = all(
      np.array_equal(np.asarray(a), np.asarray(b))
      for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(now), strict=True)
    )
    if not same:
      print(f"restored, other arrays than compressed now: {entry['spec']} ({entry['layer_loop']})")
    tally["restored, the arrays compressed now" if same else "restored, other arrays"] += 1
  print(f"{directory}: {dict(tally)}")
  return 1 if tally["refused"] else 0


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("mode", choices=["save", "restore"])
  parser.add_argument("directory", type=pathlib.Path)
  args = parser.parse_args()
  if args.mode == "save":
    save(args.directory)
    return 0
  return restore(args.directory)


if __name__ == "__main__":
  sys.exit(main())
