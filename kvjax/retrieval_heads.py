"""RazorAttention's data-free retrieval-head detection, and the head profile file it produces.

Detection (Tang et al., RazorAttention): feed random token ids — a block of `block_len` ids
repeated `repeats` times, after an optional BOS — through the model once, and score every
attention head on the queries of repeats 2..R:
  - echo score: attention mass on the *same token* in earlier repeats (key j = i - k·block_len);
  - induction score: attention mass on the token *after* it (key j = i - k·block_len + 1);
each averaged over those queries (and over `batch` independent random blocks). A KV head's
score is the max over its query group. Across all layers and KV heads, the top
`induction_ratio` by induction score and the top `echo_ratio` by echo score (each
ceil(ratio x number of KV heads)) are the retrieval heads, which keep the full cache.

The scores are computed by a probe cache method (`HeadScoreProbe`) whose layer caches score
the rotated queries and keys the decoder hands to `ingest`, chunked over queries so the
prompt x prompt matrix never exists for all heads at once. Any `CachedDecoder` works; nothing
here imports `models`. The result is a `HeadProfile`, saved once per model as JSON.
"""

import dataclasses
import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache_protocol import ModelCacheShape, check_count
from kvjax.layer_runs import flatten_layer_caches
from kvjax.model_keyed_profile import ModelKeyedProfile
from kvjax.prompt_probe_cache import PromptProbeLayerCache

PROFILE_FORMAT = "kvjax-head-profile"
PROFILE_VERSION = 1


def echo_induction_scores(
  queries: jax.Array,  # [batch, kv_heads, group, prompt, head_dim], rotated
  keys: jax.Array,  # [batch, kv_heads, prompt, head_dim], rotated
  lengths: jax.Array,  # int32 [batch]
  *,
  block_len: int,
  prefix_len: int,
  sm_scale: float,
  query_chunk: int = 256,
  sliding_window: int | None = None,
) -> tuple[jax.Array, jax.Array]:  # (echo, induction) float32 [batch, kv_heads, group]
  """Mean echo and induction attention of each query head over the queries of repeats 2..R.

  Token i (i >= prefix_len) of the probe is block[(i - prefix_len) % block_len]; the first
  `prefix_len` tokens (BOS) are not part of the repeated block. With `sliding_window`, a query
  attends as the model does: to keys fewer than `sliding_window` positions back.
  """
  prompt_len = keys.shape[2]
  chunk = min(query_chunk, prompt_len)
  num_chunks = -(-prompt_len // chunk)
  padded_queries = jnp.pad(queries, ((0, 0),) * 3 + ((0, num_chunks * chunk - prompt_len), (0, 0)))
  keys32 = keys.astype(jnp.float32)
  key_positions = jnp.arange(prompt_len)

  def add_chunk(totals, start):
    echo_total, induction_total = totals
    q = jax.lax.dynamic_slice_in_dim(padded_queries, start, chunk, axis=3).astype(jnp.float32)
    scores = jnp.einsum("bhgcd,bhtd->bhgct", q, keys32) * sm_scale
    query_positions = start + jnp.arange(chunk)
    distance = query_positions[:, None] - key_positions[None, :]  # [chunk, prompt]
    attended = distance >= 0
    if sliding_window is not None:
      attended &= distance < sliding_window
    scores = jnp.where(attended, scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    # Same token k repeats back, and the token right after that earlier occurrence.
    echo_target = (distance > 0) & (distance % block_len == 0) & (key_positions >= prefix_len)
    induction_target = (
      (distance > 0) & ((distance + 1) % block_len == 0) & (key_positions >= prefix_len + 1)
    )
    echo_mass = jnp.einsum("bhgct,ct->bhgc", probs, echo_target.astype(jnp.float32))
    induction_mass = jnp.einsum("bhgct,ct->bhgc", probs, induction_target.astype(jnp.float32))
    scored = (query_positions[None, :] - prefix_len >= block_len) & (
      query_positions[None, :] < lengths[:, None]
    )  # [batch, chunk]: queries in repeats 2..R of a real row
    weight = scored[:, None, None, :].astype(jnp.float32)
    return (
      echo_total + (echo_mass * weight).sum(-1),
      induction_total + (induction_mass * weight).sum(-1),
    ), None

  zeros = jnp.zeros(queries.shape[:3], jnp.float32)
  (echo_total, induction_total), _ = jax.lax.scan(
    add_chunk, (zeros, zeros), jnp.arange(num_chunks) * chunk
  )
  num_scored = jnp.maximum(lengths - prefix_len - block_len, 1).astype(jnp.float32)
  return echo_total / num_scored[:, None, None], induction_total / num_scored[:, None, None]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HeadScoreProbeLayerCache(PromptProbeLayerCache):
  """Not a cache: it keeps one layer's echo/induction scores instead of K/V (prefill only)."""

  echo: jax.Array  # float32 [batch, kv_heads, group]
  induction: jax.Array  # float32 [batch, kv_heads, group]
  block_len: int = dataclasses.field(metadata=dict(static=True))
  prefix_len: int = dataclasses.field(metadata=dict(static=True))
  sm_scale: float = dataclasses.field(metadata=dict(static=True))
  query_chunk: int = dataclasses.field(metadata=dict(static=True))
  sliding_window: int | None = dataclasses.field(default=None, metadata=dict(static=True))

  def ingest(self, keys, values, queries, lengths):
    del values
    echo, induction = echo_induction_scores(
      queries,
      keys,
      lengths.astype(jnp.int32),
      block_len=self.block_len,
      prefix_len=self.prefix_len,
      sm_scale=self.sm_scale,
      query_chunk=self.query_chunk,
      sliding_window=self.sliding_window,
    )
    return dataclasses.replace(self, echo=echo, induction=induction)


@dataclasses.dataclass(frozen=True)
class HeadScoreProbe:
  """Cache method whose layer caches score echo/induction attention (for `compute_head_profile`)."""

  block_len: int
  prefix_len: int = 0
  query_chunk: int = 256

  def __post_init__(self):
    check_count("block_len", self.block_len, 2)
    check_count("prefix_len", self.prefix_len, 0)
    check_count("query_chunk", self.query_chunk, 1)

  def allocate(self, shape: ModelCacheShape, layer, *, batch, prompt_len, max_new_tokens, dtype):
    del layer, prompt_len, max_new_tokens, dtype
    scores_shape = (batch, shape.num_kv_heads, shape.group_size)
    return HeadScoreProbeLayerCache(
      echo=jnp.zeros(scores_shape, jnp.float32),
      induction=jnp.zeros(scores_shape, jnp.float32),
      block_len=self.block_len,
      prefix_len=self.prefix_len,
      sm_scale=shape.head_dim**-0.5,
      query_chunk=self.query_chunk,
      sliding_window=shape.sliding_window,
    )


def _top_count(ratio: float, total: int) -> int:
  return 0 if ratio == 0 else min(total, math.ceil(ratio * total - 1e-9))


def select_retrieval_heads(
  induction_scores: np.ndarray,  # [layers, kv_heads]
  echo_scores: np.ndarray,  # [layers, kv_heads]
  *,
  induction_ratio: float,
  echo_ratio: float,
) -> tuple[tuple[int, int], ...]:
  """(layer, kv_head) pairs, sorted: top ceil(ratio x heads) by induction, union top by echo."""
  _check_ratio("induction_ratio", induction_ratio)
  _check_ratio("echo_ratio", echo_ratio)
  induction_scores = np.asarray(induction_scores, np.float64)
  echo_scores = np.asarray(echo_scores, np.float64)
  if induction_scores.ndim != 2 or echo_scores.shape != induction_scores.shape:
    raise ValueError(
      f"induction_scores {induction_scores.shape} and echo_scores {echo_scores.shape} must "
      "both be [layers, kv_heads]"
    )
  num_heads = induction_scores.size
  chosen = set()
  for scores, ratio in ((induction_scores, induction_ratio), (echo_scores, echo_ratio)):
    order = np.argsort(-scores.reshape(-1), kind="stable")  # ties: the earlier head
    chosen.update(int(i) for i in order[: _top_count(ratio, num_heads)])
  heads_per_layer = induction_scores.shape[1]
  return tuple(sorted(divmod(i, heads_per_layer) for i in chosen))


def _frozen(value):
  """JSON values made hashable (lists -> tuples), so a profile can sit in a jit static argument."""
  if isinstance(value, (list, tuple)):
    return tuple(_frozen(v) for v in value)
  if isinstance(value, dict):
    return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
  return value


def _check_ratio(name: str, value: float) -> None:
  if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 <= value <= 1.0:
    raise ValueError(f"{name}={value!r} must be in [0, 1] (a fraction of all KV heads)")


@dataclasses.dataclass(frozen=True)
class HeadProfile(ModelKeyedProfile):
  """Per-model retrieval-head profile: scores per (layer, KV head) and the chosen heads.

  Hashable (tuples only), so a cache method holding it can be a static argument of `jit`.
  """

  WHAT = "head profile"
  FORMAT = PROFILE_FORMAT
  VERSION = PROFILE_VERSION
  MAKE, MADE, COMMAND = "compute", "computed", "razor-profile"
  MAKER = "kvjax.retrieval_heads.compute_head_profile"

  induction_scores: tuple[tuple[float, ...], ...]  # [layer][kv_head]
  echo_scores: tuple[tuple[float, ...], ...]  # [layer][kv_head]
  retrieval_heads: tuple[tuple[int, int], ...]  # sorted (layer, kv_head)
  induction_ratio: float = 0.14
  echo_ratio: float = 0.01
  detection: tuple[tuple[str, Any], ...] = ()  # how the scores were measured (for the record)
  model_name: str = ""

  def __post_init__(self):
    expected = (self.num_layers, self.num_kv_heads)
    for name in ("induction_scores", "echo_scores"):
      scores = getattr(self, name)
      if len(scores) != self.num_layers or any(len(row) != self.num_kv_heads for row in scores):
        raise ValueError(f"head profile: {name} must be [num_layers, num_kv_heads] = {expected}")
    if len(set(self.retrieval_heads)) != len(self.retrieval_heads):
      raise ValueError(
        f"head profile: retrieval_heads {list(self.retrieval_heads)} name a (layer, kv_head) "
        "more than once; each head is a retrieval head or not"
      )
    for layer, head in self.retrieval_heads:
      if any(isinstance(i, bool) or not isinstance(i, numbers.Integral) for i in (layer, head)):
        raise ValueError(
          f"head profile: retrieval head {[layer, head]!r} must be two ints (layer, kv_head)"
        )
      if not (0 <= layer < self.num_layers and 0 <= head < self.num_kv_heads):
        raise ValueError(
          f"head profile: retrieval head (layer={layer}, kv_head={head}) is outside "
          f"num_layers={self.num_layers}, num_kv_heads={self.num_kv_heads}"
        )

  @classmethod
  def from_scores(
    cls,
    shape: ModelCacheShape,
    induction_scores: np.ndarray,  # [layers, kv_heads]
    echo_scores: np.ndarray,  # [layers, kv_heads]
    *,
    induction_ratio: float = 0.14,
    echo_ratio: float = 0.01,
    detection: dict | None = None,
    model_name: str = "",
  ) -> "HeadProfile":
    induction_scores = np.asarray(induction_scores, np.float64)
    echo_scores = np.asarray(echo_scores, np.float64)
    # First: it checks the ratios and that the scores are [layers, kv_heads].
    retrieval_heads = select_retrieval_heads(
      induction_scores, echo_scores, induction_ratio=induction_ratio, echo_ratio=echo_ratio
    )
    return cls(
      **cls.counts_of(shape),
      induction_scores=tuple(tuple(float(s) for s in row) for row in induction_scores),
      echo_scores=tuple(tuple(float(s) for s in row) for row in echo_scores),
      retrieval_heads=retrieval_heads,
      induction_ratio=float(induction_ratio),
      echo_ratio=float(echo_ratio),
      detection=_frozen(detection or {}),
      model_name=model_name,
    )

  def __repr__(self) -> str:  # the scores are long; describe_method prints this
    name = f"{self.model_name}: " if self.model_name else ""
    return (
      f"HeadProfile({name}{self.num_layers} layers x {self.num_kv_heads} KV heads, "
      f"{len(self.retrieval_heads)} retrieval heads)"
    )

  def retrieval_heads_of_layer(self, layer: int) -> tuple[int, ...]:
    return tuple(head for at_layer, head in self.retrieval_heads if at_layer == layer)

  def to_json_dict(self) -> dict:
    return dict(
      **self.file_header(self.model_name),
      induction_ratio=self.induction_ratio,
      echo_ratio=self.echo_ratio,
      detection=dict(self.detection),
      induction_scores=[list(row) for row in self.induction_scores],
      echo_scores=[list(row) for row in self.echo_scores],
      retrieval_heads=[list(pair) for pair in self.retrieval_heads],
    )

  @classmethod
  def from_json_dict(cls, data: dict, *, source: str = "head profile") -> "HeadProfile":
    try:
      return cls(
        **cls.read_header(data, source=source),
        induction_scores=tuple(tuple(float(s) for s in row) for row in data["induction_scores"]),
        echo_scores=tuple(tuple(float(s) for s in row) for row in data["echo_scores"]),
        # Taken as stored: __post_init__ refuses a float index rather than truncate it.
        retrieval_heads=tuple(sorted(tuple(pair) for pair in data["retrieval_heads"])),
        induction_ratio=float(data["induction_ratio"]),
        echo_ratio=float(data["echo_ratio"]),
        detection=_frozen(data.get("detection", {})),
        model_name=str(data["model"].get("name", "")),
      )
    except (KeyError, TypeError, AttributeError) as error:
      raise ValueError(f"{source}: malformed head profile ({error})") from error
    except ValueError as error:
      if str(error).startswith(source):
        raise
      raise ValueError(f"{source}: malformed head profile ({error})") from error


def probe_tokens(
  *,
  vocab_size: int,
  block_len: int,
  repeats: int,
  batch: int = 1,
  seed: int = 0,
  bos_token_id: int | None = None,
  token_range: tuple[int, int] | None = None,
) -> np.ndarray:  # int32 [batch, (bos) + block_len * repeats]
  """Random blocks from a mid-vocabulary range (default: the middle half), each repeated."""
  check_count("block_len", block_len, 1)
  check_count("repeats", repeats, 1)
  check_count("batch", batch, 1)
  check_count("seed", seed, 0)
  if token_range is not None and (
    not isinstance(token_range, (tuple, list))
    or len(token_range) != 2
    or any(isinstance(v, bool) or not isinstance(v, (int, np.integer)) for v in token_range)
  ):
    # A float bound would be truncated by the generator (10.5 draws 10).
    raise ValueError(f"token_range={token_range!r} must be a pair of ints (low, high)")
  low, high = token_range if token_range is not None else (vocab_size // 4, 3 * vocab_size // 4)
  if not 0 <= low < high <= vocab_size or high - low < 2:
    raise ValueError(
      f"token_range=({low}, {high}) must hold at least 2 ids within [0, vocab_size={vocab_size}]"
    )
  blocks = np.random.default_rng(seed).integers(low, high, size=(batch, block_len))
  tokens = np.tile(blocks, (1, repeats))
  if bos_token_id is not None:
    tokens = np.concatenate([np.full((batch, 1), bos_token_id), tokens], axis=1)
  return tokens.astype(np.int32)


def compute_head_profile(
  decoder,
  params,
  *,
  vocab_size: int,
  block_len: int = 2500,
  repeats: int = 4,
  seed: int = 0,
  induction_ratio: float = 0.14,
  echo_ratio: float = 0.01,
  batch: int = 1,
  bos_token_id: int | None = None,
  token_range: tuple[int, int] | None = None,
  query_chunk: int = 256,
  max_positions: int | None = None,
  model_name: str = "",
) -> HeadProfile:
  """Scores every KV head of `decoder` (any `CachedDecoder`) on a random repeated block.

  One prefill of `batch` rows of `(BOS) + block_len x repeats` tokens; scores are averaged over
  the rows. The probe RazorAttention specifies starts with BOS: pass the model's `bos_token_id`
  (`kvjax razor-profile` does; None leaves it out). `max_positions` (the model's context length)
  bounds the probe length; None checks nothing.
  """
  from kvjax.generate import prefill  # generate imports the cache modules; keep this one light

  check_count("block_len", block_len, 2)
  check_count("repeats", repeats, 2)  # scores are read on repeats 2..R
  check_count("batch", batch, 1)
  check_count("query_chunk", query_chunk, 1)
  _check_ratio("induction_ratio", induction_ratio)
  _check_ratio("echo_ratio", echo_ratio)
  prefix_len = 0 if bos_token_id is None else 1
  probe_len = prefix_len + block_len * repeats
  if max_positions is not None and probe_len > max_positions:
    raise ValueError(
      f"probe of {probe_len} tokens (block_len={block_len} x repeats={repeats}"
      f"{' + BOS' if prefix_len else ''}) exceeds the model's context of {max_positions}; "
      "lower block_len or repeats"
    )
  tokens = probe_tokens(
    vocab_size=vocab_size,
    block_len=block_len,
    repeats=repeats,
    batch=batch,
    seed=seed,
    bos_token_id=bos_token_id,
    token_range=token_range,
  )
  lengths = np.full((batch,), probe_len, np.int32)
  probe = HeadScoreProbe(block_len=block_len, prefix_len=prefix_len, query_chunk=query_chunk)
  _, caches = prefill(
    decoder,
    params,
    jnp.asarray(tokens),
    jnp.asarray(lengths),
    cache_method=probe,
    max_new_tokens=0,
    cache_dtype=jnp.float32,
  )
  # A decoder scanning its layers returns the (look-alike) probe caches stacked: one per layer.
  caches = flatten_layer_caches(caches)
  # [layers, batch, kv_heads, group] -> mean over rows, then max over each KV head's group.
  echo = np.stack([np.asarray(c.echo) for c in caches]).mean(axis=1).max(axis=-1)
  induction = np.stack([np.asarray(c.induction) for c in caches]).mean(axis=1).max(axis=-1)
  return HeadProfile.from_scores(
    decoder.cache_shape,
    induction,
    echo,
    induction_ratio=induction_ratio,
    echo_ratio=echo_ratio,
    detection=dict(
      block_len=block_len,
      repeats=repeats,
      seed=seed,
      batch=batch,
      bos=bos_token_id is not None,
      token_range=list(token_range) if token_range else None,
    ),
    model_name=model_name,
  )
