"""DuoAttention's gates, trained (Xiao et al., DuoAttention; METHODS.md).

Every KV head of every layer gets a gate alpha in [0, 1]; while training, each of its query
heads outputs alpha x full causal attention + (1 - alpha) x streaming attention (the first
`sinks` tokens and the last `recent`). Only the gates are trained, the model's weights stay
fixed: the loss is the mean squared difference between the final hidden states of this mixed
model and of the full model on the supervised (answer) positions of synthetic passkey
prompts, plus `l1_weight` x mean |alpha|. AdamW without weight decay on the authors' warm-up
and decay schedule (`GateTraining`; they run 2000 steps at 0.02), each gate clipped back into
[0, 1] after every step; the gates start at 1 (every head full).

The mixed attention reaches the model through its layer caches: a decoder's prefill asks a
cache with a `prompt_attention` method how the prompt attends
(`kvjax.prefill_attention.cache_prompt_attention`, which models/attention.py calls), and
`prefill_hidden_states` hands back the final normalized hidden states instead of logits
(models/nnx_decoder.py). Nothing here imports `models`.

Training data (`passkey_training_samples`): text from a corpus (the pydoc topics by default),
with `passkeys` pass keys of `passkey_words` random words each at random depths, and at the end
a request to recite them followed by the keys themselves: the recited keys are the supervised
positions, where only a head that reaches back past the recent window can help.
"""

import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np
import optax

from kvjax.cache_protocol import check_count
from kvjax.decoder_protocol import check_prompt_attention, decoder_vocab_size
from kvjax.eval.continuation import special_prefix
from kvjax.eval.text_corpus import pydoc_topics_text
from kvjax.prefill_attention import over_query_chunks
from kvjax.prompt_batch import check_row_lengths
from kvjax.prompt_probe_cache import PromptProbeLayerCache

PASSKEY_SENTENCE = "The pass key number {number} is: {words}. Remember it. "
RECITE_REQUEST = "\nRecite the pass keys, in order.\n"
RECITED_KEY = "The pass key number {number} is: {words}.\n"


def gated_prompt_attention(
  queries: jax.Array,  # [batch, kv_heads, group, prompt, head_dim], rotated
  keys: jax.Array,  # [batch, kv_heads, prompt, head_dim], rotated
  values: jax.Array,  # [batch, kv_heads, prompt, head_dim]
  gates: jax.Array,  # float32 [kv_heads]
  *,
  sinks: int,
  recent: int,
  sm_scale: float,
  sliding_window: int | None = None,
  query_chunk: int = 256,
) -> jax.Array:  # [batch, kv_heads, group, prompt, head_dim], the dtype of `queries`
  """Per KV head, gate x causal attention + (1 - gate) x attention over the first `sinks`
  tokens and the last `recent` (the query's own token included), in float32.

  Chunked over queries and rematerialized, so neither the forward pass nor its gradient holds
  the prompt x prompt scores of more than one chunk.
  """
  keys32, values32 = keys.astype(jnp.float32), values.astype(jnp.float32)
  key_positions = jnp.arange(keys.shape[2])
  gate = gates.astype(jnp.float32)[None, :, None, None, None]

  def weighted_values(scores, allowed):
    scores = jnp.where(allowed, scores, -jnp.inf)
    weights = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("bhgqk,bhkd->bhgqd", weights, values32)

  @jax.checkpoint
  def one_chunk(chunk_queries, start):
    scores = jnp.einsum("bhgqd,bhkd->bhgqk", chunk_queries.astype(jnp.float32), keys32) * sm_scale
    distance = (start + jnp.arange(chunk_queries.shape[3]))[:, None] - key_positions[None, :]
    causal = distance >= 0
    if sliding_window is not None:
      causal &= distance < sliding_window
    streaming = causal & ((key_positions[None, :] < sinks) | (distance < recent))
    full = weighted_values(scores, causal)
    local = weighted_values(scores, streaming)
    return gate * full + (1.0 - gate) * local

  return over_query_chunks(one_chunk, queries, query_chunk=query_chunk).astype(queries.dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DuoGateLayerCache(PromptProbeLayerCache):
  """Not a cache: one layer's gates, which make the prompt attend as the mixed model does
  (prefill only; it stores nothing)."""

  gates: jax.Array  # float32 [kv_heads]
  sinks: int = dataclasses.field(metadata=dict(static=True))
  recent: int = dataclasses.field(metadata=dict(static=True))
  query_chunk: int = dataclasses.field(default=256, metadata=dict(static=True))

  def prompt_attention(self, queries, keys, values, lengths, *, sm_scale, sliding_window):
    del lengths  # causal: a row's own tokens never attend to its padding
    return gated_prompt_attention(
      queries,
      keys,
      values,
      self.gates,
      sinks=self.sinks,
      recent=self.recent,
      sm_scale=sm_scale,
      sliding_window=sliding_window,
      query_chunk=self.query_chunk,
    )

  def ingest(self, keys, values, queries, lengths):
    return self


def check_gate_training_decoder(decoder) -> None:
  """The decoder hands back final hidden states, and its prefill attends as the gate caches say
  (without that, the distillation has no gradient and the gates learn the penalty alone)."""
  if not callable(getattr(decoder, "prefill_hidden_states", None)):
    raise ValueError(
      f"decoder: {type(decoder).__qualname__} lacks prefill_hidden_states(params, tokens, "
      "lengths, caches) -> (final hidden states [batch, prompt, hidden], caches), which "
      "DuoAttention's gate training distils (models/nnx_decoder.py has one)"
    )
  probe = DuoGateLayerCache(jnp.ones((1,), jnp.float32), sinks=0, recent=1)
  check_prompt_attention(decoder, (probe,), method_name="duo gate training")


def gate_caches(gates: jax.Array, *, sinks: int, recent: int, query_chunk: int) -> tuple:
  """One `DuoGateLayerCache` per layer from gates [layers, kv_heads]."""
  return tuple(
    DuoGateLayerCache(gates[layer], sinks=sinks, recent=recent, query_chunk=query_chunk)
    for layer in range(gates.shape[0])
  )


@dataclasses.dataclass(frozen=True)
class PasskeySamples:
  tokens: np.ndarray  # int32 [samples, width], right-padded
  lengths: np.ndarray  # int32 [samples]
  supervised: np.ndarray  # bool [samples, width]: the recited keys' positions


def passkey_training_samples(
  tokenizer,
  *,
  context_len: int,
  num_samples: int,
  passkeys: int = 10,
  passkey_words: int = 32,
  seed: int = 0,
  text: str | None = None,
) -> PasskeySamples:
  """`num_samples` prompts of exactly `context_len` tokens: what the tokenizer puts before any
  text (Llama's BOS: the first token, a natural sink, as the model always sees it; nothing for
  SmolLM2), then corpus text with the pass keys spread at random depths, ending with the request
  and the keys recited (module docstring)."""
  check_count("context_len", context_len, 2)
  check_count("num_samples", num_samples, 1)
  check_count("passkeys", passkeys, 1)
  check_count("passkey_words", passkey_words, 1)
  text = pydoc_topics_text() if text is None else text
  vocabulary = sorted({word for word in text.split() if word.isalpha()})
  if len(vocabulary) < 2:
    raise ValueError("text: too few distinct alphabetic words to draw pass keys from")
  prefix = special_prefix(tokenizer)
  rng = np.random.default_rng(seed)
  tokens = np.zeros((num_samples, context_len), np.int32)
  supervised = np.zeros((num_samples, context_len), bool)
  for sample in range(num_samples):
    keys = [" ".join(rng.choice(vocabulary, passkey_words)) for _ in range(passkeys)]
    hidden = [
      tokenizer.encode(PASSKEY_SENTENCE.format(number=i + 1, words=w)) for i, w in enumerate(keys)
    ]
    request = tokenizer.encode(RECITE_REQUEST)
    recited = [
      tokenizer.encode(RECITED_KEY.format(number=i + 1, words=w)) for i, w in enumerate(keys)
    ]
    answer_len = sum(map(len, recited))
    filler_len = context_len - len(prefix) - sum(map(len, hidden)) - len(request) - answer_len
    if filler_len < passkeys:
      raise ValueError(
        f"context_len={context_len} is too short for {passkeys} pass keys of {passkey_words} "
        f"words: they, the request, the recital and the tokenizer's prefix take "
        f"{context_len - filler_len} tokens; "
        "raise context_len or lower passkeys / passkey_words"
      )
    filler = _corpus_tokens(tokenizer, text, filler_len, rng)
    cuts = np.sort(rng.choice(np.arange(filler_len + 1), passkeys, replace=True))
    pieces, previous = [prefix], 0
    for cut, key_tokens in zip(cuts, hidden):
      pieces += [filler[previous:cut], key_tokens]
      previous = cut
    pieces += [filler[previous:], request, *recited]
    row = np.concatenate([np.asarray(p, np.int64) for p in pieces])
    assert row.size == context_len, (row.size, context_len)
    tokens[sample] = row
    supervised[sample, context_len - answer_len :] = True
  return PasskeySamples(tokens, np.full((num_samples,), context_len, np.int32), supervised)


def _corpus_tokens(tokenizer, text: str, count: int, rng) -> list[int]:
  """`count` consecutive tokens of `text` from a random place (wrapping around)."""
  characters = max(64, 8 * count)  # English text is under 8 characters per token
  start = int(rng.integers(0, len(text)))
  window = (text * (characters // len(text) + 2))[start : start + characters]
  ids = tokenizer.encode(window)
  while len(ids) < count:  # a text of long tokens: take more
    ids += tokenizer.encode(window)
  return ids[:count]


LEARNING_RATE_SCHEDULES = ("warmup_decay", "constant")


@dataclasses.dataclass(frozen=True)
class GateTraining:
  """The authors' settings (METHODS.md; their train.py), except the number of steps, which a
  caller sizes. `lr_schedule="warmup_decay"` is theirs: the learning rate times
  min(1, max((step + 1) / (steps // 5), 0.1), max((steps - step) / (steps // 5), 0.1)), a
  warm-up over the first fifth and a decay over the last, never under a tenth; "constant"
  keeps it. AdamW without weight decay (`weight_decay`, as theirs)."""

  sinks: int = 64
  recent: int = 256
  steps: int = 2000
  learning_rate: float = 0.02
  l1_weight: float = 0.05
  batch: int = 1
  query_chunk: int = 256
  weight_decay: float = 0.0
  lr_schedule: str = "warmup_decay"

  def __post_init__(self):
    check_count("sinks", self.sinks, 0)
    check_count("recent", self.recent, 1)
    check_count("steps", self.steps, 1)
    check_count("batch", self.batch, 1)
    check_count("query_chunk", self.query_chunk, 1)
    for name in ("learning_rate", "l1_weight", "weight_decay"):
      value = getattr(self, name)
      if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(value)
        or value < 0
      ):
        raise ValueError(f"{name}={value!r} must be a finite number >= 0")
    if self.lr_schedule not in LEARNING_RATE_SCHEDULES:
      raise ValueError(
        f"lr_schedule={self.lr_schedule!r}; allowed: {', '.join(LEARNING_RATE_SCHEDULES)}"
      )

  def learning_rate_at(self, step: jax.Array) -> jax.Array:
    """The learning rate of optimizer step `step` (0-based). Under 5 steps, where the authors'
    formula would divide by zero (steps // 5 = 0), a fifth counts as one step: a constant rate."""
    step = jnp.asarray(step, jnp.float32)
    if self.lr_schedule == "constant":
      return jnp.full_like(step, self.learning_rate)
    fifth = max(self.steps // 5, 1)
    warmup = jnp.maximum((step + 1) / fifth, 0.1)
    decay = jnp.maximum((self.steps - step) / fifth, 0.1)
    return self.learning_rate * jnp.minimum(1.0, jnp.minimum(warmup, decay))

  def as_record(self) -> dict:
    return dataclasses.asdict(self)


def check_training_samples(samples: PasskeySamples, *, vocab_size: int | None) -> None:
  """Rows as a prefill takes them (ids in the vocabulary, lengths in [1, width]), and a
  supervised mask of their shape with at least one supervised position in every row, all
  within the row: a row without one trains the gates on the L1 penalty alone."""
  check_row_lengths(samples.tokens, samples.lengths, vocab_size=vocab_size, name="samples.tokens")
  supervised = np.asarray(samples.supervised)
  if supervised.shape != np.shape(samples.tokens) or supervised.dtype != bool:
    raise ValueError(
      f"samples.supervised must be bool of the tokens' shape {np.shape(samples.tokens)}; got "
      f"{supervised.dtype} {supervised.shape}"
    )
  past_length = np.arange(supervised.shape[1])[None, :] >= np.asarray(samples.lengths)[:, None]
  if (supervised & past_length).any():
    row = int(np.argmax((supervised & past_length).any(axis=1)))
    raise ValueError(f"samples.supervised: row {row} supervises positions past its length")
  if not supervised.any(axis=1).all():
    row = int(np.argmin(supervised.any(axis=1)))
    raise ValueError(f"samples.supervised: row {row} has no supervised position")


def train_duo_gates(
  decoder,
  params,
  samples: PasskeySamples,
  settings: GateTraining = GateTraining(),
  *,
  progress: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
  """(gates float32 [layers, kv_heads], loss per step [steps]) trained on `samples`, rows
  taken `settings.batch` at a time in order (wrapping around)."""
  check_gate_training_decoder(decoder)
  check_training_samples(samples, vocab_size=decoder_vocab_size(decoder))
  shape = decoder.cache_shape
  tokens = jnp.asarray(samples.tokens)
  lengths = jnp.asarray(samples.lengths)
  supervised = jnp.asarray(samples.supervised)
  num_samples = tokens.shape[0]
  if settings.batch > num_samples:
    raise ValueError(f"batch={settings.batch} must be <= the number of samples ({num_samples})")
  if tokens.shape[1] <= settings.sinks + settings.recent:
    # A streaming head would then see every token, and the gates learn only the L1 penalty.
    raise ValueError(
      f"samples of {tokens.shape[1]} tokens must be longer than sinks + recent = "
      f"{settings.sinks + settings.recent}: raise context_len or lower sinks / recent"
    )
  caches_of = lambda gates: gate_caches(
    gates, sinks=settings.sinks, recent=settings.recent, query_chunk=settings.query_chunk
  )

  @jax.jit
  def full_hidden(rows):  # gates of 1: every head attends causally, as the full model
    ones = jnp.ones((shape.num_layers, shape.num_kv_heads), jnp.float32)
    return decoder.prefill_hidden_states(params, tokens[rows], lengths[rows], caches_of(ones))[0]

  targets = jnp.concatenate([full_hidden(jnp.arange(i, i + 1)) for i in range(num_samples)], axis=0)

  def loss_of(gates, rows):
    hidden, _ = decoder.prefill_hidden_states(params, tokens[rows], lengths[rows], caches_of(gates))
    mask = supervised[rows][..., None]
    squared = jnp.where(mask, (hidden - targets[rows]) ** 2, 0.0)
    distill = squared.sum() / (jnp.maximum(mask.sum(), 1) * hidden.shape[-1])
    return distill + settings.l1_weight * jnp.abs(gates).mean()

  constant = settings.lr_schedule == "constant"
  optimizer = optax.adamw(
    settings.learning_rate if constant else settings.learning_rate_at,
    weight_decay=settings.weight_decay,
  )

  @jax.jit
  def step(gates, state, rows):
    loss, grad = jax.value_and_grad(loss_of)(gates, rows)
    updates, state = optimizer.update(grad, state, gates)
    return jnp.clip(optax.apply_updates(gates, updates), 0.0, 1.0), state, loss

  gates = jnp.ones((shape.num_layers, shape.num_kv_heads), jnp.float32)
  state = optimizer.init(gates)
  losses = np.zeros((settings.steps,), np.float32)
  iterator = range(settings.steps)
  if progress:
    from tqdm import tqdm

    iterator = tqdm(iterator, desc="duo gates", unit="step")
  for i in iterator:
    rows = (i * settings.batch + jnp.arange(settings.batch)) % num_samples
    gates, state, loss = step(gates, state, rows)
    losses[i] = float(loss)
    if progress:
      iterator.set_postfix(loss=f"{losses[i]:.4g}")
  return np.asarray(gates), losses
