"""Which needle tokens a selection method keeps, layer by layer and head by head.

    python benchmarks/needle_token_survival.py --methods h2o:ratio=0.2 snapkv:ratio=0.2

For each RULER-style needle prompt of `kvjax compare` (query-aware: context + question), the
prompt is prefilled through a probe cache that runs each method's own selector at ingest and
records the kept token indices. Printed per method and needle depth: the share of (layer, KV
head) pairs that keep all 5 digits of the key (losing one digit token breaks the answer), and
the share of digit tokens kept overall, and the share of all kept tokens that lie in the first
half of the prompt (accumulated attention favours early tokens: token i is summed over the
attention of every later query).
"""

import argparse
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.dense_cache import DenseLayerCache
from kvjax.eval.needle import build_needle_prompts
from kvjax.generate import prefill
from kvjax.method_spec import parse_method_spec
from kvjax.prompt_batch import pack_prompts
from models.loading import load_model


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KeptIndicesProbe:
  """A dense cache that also records which prompt tokens `selector` would keep."""

  dense: DenseLayerCache
  kept: jax.Array  # int32 [batch, kv_heads, budget]
  selector: Any = dataclasses.field(metadata=dict(static=True))

  def ingest(self, keys, values, queries, lengths):
    kept, _ = self.selector.kept_indices(keys, queries, lengths)
    return dataclasses.replace(
      self, dense=self.dense.ingest(keys, values, queries, lengths), kept=kept
    )

  def append(self, keys, values):
    return dataclasses.replace(self, dense=self.dense.append(keys, values))

  def attend(self, queries, *, sm_scale):
    return self.dense.attend(queries, sm_scale=sm_scale)


@dataclasses.dataclass(frozen=True)
class ProbeMethod:
  selection: Any  # a selection method with `selector(shape, prompt_len)` (h2o, snapkv)

  def allocate(self, shape, layer, *, batch, prompt_len, max_new_tokens, dtype):
    selector = self.selection.selector(shape, prompt_len)
    return KeptIndicesProbe(
      dense=DenseLayerCache.zeros(
        batch=batch,
        kv_heads=shape.num_kv_heads,
        capacity=prompt_len + max_new_tokens,
        head_dim=shape.head_dim,
        dtype=dtype,
      ),
      kept=jnp.zeros((batch, shape.num_kv_heads, selector.budget), jnp.int32),
      selector=selector,
    )


def digit_positions(prompt_ids: list[int], key_ids: list[int]) -> list[int]:
  for start in range(len(prompt_ids) - len(key_ids) + 1):
    if prompt_ids[start : start + len(key_ids)] == key_ids:
      return list(range(start, start + len(key_ids)))
  raise ValueError("the key's tokens are not in the prompt")


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--methods", nargs="+", default=["h2o:ratio=0.2", "snapkv:ratio=0.2"])
  parser.add_argument("--context-len", type=int, default=1024)
  parser.add_argument("--num-samples", type=int, default=2)
  args = parser.parse_args()
  model = load_model("smollm2-135m")
  prompts = build_needle_prompts(
    model.tokenizer, context_len=args.context_len, num_samples=args.num_samples, seed=0
  )
  token_lists = [p.context_ids + p.question_ids for p in prompts]
  tokens, lengths = pack_prompts(token_lists, pad_token_id=0)
  digits = [
    digit_positions(ids, model.tokenizer.encode(p.key)) for ids, p in zip(token_lists, prompts)
  ]
  print(f"{len(prompts)} prompts of {tokens.shape[1]} tokens at most; 5-digit keys")
  print(
    "method | depth | (layer, head) pairs keeping all 5 digits | digit tokens kept | "
    "kept tokens in the prompt's first half"
  )
  for spec in args.methods:
    method = ProbeMethod(parse_method_spec(spec))
    _, caches = prefill(
      model.decoder,
      model.params,
      tokens,
      lengths,
      cache_method=method,
      max_new_tokens=0,
      cache_dtype=jnp.bfloat16,
    )
    kept = np.stack([np.asarray(c.kept) for c in caches])  # [layers, batch, heads, budget]
    for depth in sorted({p.depth for p in prompts}):
      rows = [i for i, p in enumerate(prompts) if p.depth == depth]
      all_kept, each_kept, early = [], [], []
      for row in rows:
        early.append((kept[:, row] < lengths[row] // 2).mean())
        present = np.stack(  # [layers, heads, 5]: is each digit token kept there
          [
            [np.isin(digits[row], kept[layer, row, head]) for head in range(kept.shape[2])]
            for layer in range(kept.shape[0])
          ]
        )
        all_kept.append(present.all(-1).mean())
        each_kept.append(present.mean())
      print(
        f"{spec} | {depth} | {np.mean(all_kept):.3f} | {np.mean(each_kept):.3f} | "
        f"{np.mean(early):.3f}",
        flush=True,
      )


if __name__ == "__main__":
  main()
