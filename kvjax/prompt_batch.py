"""Turning prompts of different lengths into the compact (right-padded) rows caches store."""

from collections.abc import Sequence

import jax
import numpy as np

# Token ids are int32 on device: the exclusive bound of an id kvjax can carry.
INT32_IDS = 2**31


def check_token_lists(token_lists, *, name: str) -> None:
  """ValueError unless `token_lists` is a sequence (a list, a tuple, an array) of token lists:
  None, a number or a generator has no rows to count."""
  if isinstance(token_lists, (str, bytes)) or not hasattr(token_lists, "__len__"):
    raise ValueError(
      f"{name} must be a list of token lists (one list of int ids a row), got "
      f"{type(token_lists).__qualname__}"
    )


def pack_prompts(
  prompts: Sequence[Sequence[int]], *, pad_token_id: int = 0
) -> tuple[np.ndarray, np.ndarray]:
  """Ragged token lists -> (tokens int32 [batch, longest] right-padded, lengths int32 [batch])."""
  check_token_lists(prompts, name="prompts")
  if len(prompts) == 0:
    raise ValueError("prompts must hold at least one prompt")
  tokens, lengths = pack_token_lists(prompts, pad_token_id=pad_token_id, name="prompts")
  if lengths.min() < 1:
    raise ValueError(f"every prompt needs at least one token; got lengths {lengths.tolist()}")
  return tokens, lengths


def check_pad_token_id(pad_token_id) -> None:
  """An int id int32 holds (whether the vocabulary has it is checked where the size is known):
  a tokenizer's `pad_token_id` is None for Llama, and None, 1.7 or "0" reached numpy's own
  errors, or were truncated to an id without a word."""
  if isinstance(pad_token_id, bool) or not isinstance(pad_token_id, (int, np.integer)):
    raise ValueError(f"pad_token_id={pad_token_id!r} must be an int token id")
  check_ids_fit_int32(np.array([pad_token_id], np.int64), name="pad_token_id")


def pack_token_lists(
  token_lists: Sequence[Sequence[int]], *, pad_token_id: int, name: str
) -> tuple[np.ndarray, np.ndarray]:
  """Token lists of any lengths, empty ones too -> (int32 [count, longest] right-padded with
  `pad_token_id`, lengths int32 [count]). A list holding anything but int ids is refused by
  `name[row]` (int32 would truncate 1.5 to 1 without a word)."""
  check_pad_token_id(pad_token_id)
  arrays = [np.asarray(ids) for ids in token_lists]
  for row, array in enumerate(arrays):
    if array.ndim != 1 or (array.size and not np.issubdtype(array.dtype, np.integer)):
      raise ValueError(f"{name}[{row}] must be a list of int token ids, got {token_lists[row]!r}")
    check_ids_fit_int32(array, name=f"{name}[{row}]")
  lengths = np.array([array.size for array in arrays], np.int32)
  tokens = np.full((len(arrays), lengths.max(initial=0)), pad_token_id, np.int32)
  for row, array in enumerate(arrays):
    tokens[row, : array.size] = array
  return tokens, lengths


def compact_padded_batch(
  tokens: np.ndarray,  # int [batch, tokens], left- or right-padded
  attention_mask: np.ndarray,  # {0, 1} [batch, tokens]; 1 marks real tokens
  *,
  pad_token_id: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
  """A padded batch with a Hugging Face style mask -> compact rows and their lengths.

  Real tokens of each row must be contiguous (left padding, right padding, or none).
  `pad_token_id` is checked by `pack_prompts`.
  """
  try:
    tokens, mask = np.asarray(tokens), np.asarray(attention_mask)
  except ValueError as error:  # numpy's "inhomogeneous shape" for ragged rows
    raise ValueError(
      f"tokens and attention_mask must be rectangular [batch, tokens] arrays ({error})"
    ) from None
  if tokens.size and not np.issubdtype(tokens.dtype, np.integer):
    raise ValueError(f"tokens must hold int token ids, got dtype {tokens.dtype}")
  # Any nonzero value would otherwise mark a real token (-1, 0.5 or 2 a padding one).
  if mask.dtype != bool and mask.size and not np.isin(mask, (0, 1)).all():
    bad = mask[~np.isin(mask, (0, 1))].flat[0].item()
    raise ValueError(f"attention_mask holds {bad!r}; it must hold only 0 and 1 (or booleans)")
  mask = mask.astype(bool)
  if tokens.shape != mask.shape or tokens.ndim != 2:
    raise ValueError(
      f"tokens {tokens.shape} and attention_mask {mask.shape} must both be [batch, tokens]"
    )
  rows = []
  for row, (ids, keep) in enumerate(zip(tokens, mask)):
    real = np.flatnonzero(keep)
    if real.size == 0 or real[-1] - real[0] + 1 != real.size:
      raise ValueError(
        f"attention_mask row {row} must mark one contiguous, non-empty run of tokens"
      )
    rows.append(ids[real].tolist())
  return pack_prompts(rows, pad_token_id=pad_token_id)


def check_padded_token_ids(
  tokens: np.ndarray, *, pad_token_id: int, vocab_size: int | None, name: str
) -> None:
  """`check_token_ids` for `pad_token_id`, then for `tokens` padded with it."""
  check_token_ids(np.array([pad_token_id]), vocab_size=vocab_size, name="pad_token_id")
  check_token_ids(tokens, vocab_size=vocab_size, name=name)


def check_ids_fit_int32(ids: np.ndarray, *, name: str) -> None:
  """Refuses ids int32 cannot hold, before they are cast to it: the cast would wrap 2**32 + 5
  to 5, an id of the vocabulary, and the vocabulary check after it could not tell."""
  ids = np.asarray(ids)
  if ids.size == 0:
    return
  low, high = int(ids.min()), int(ids.max())
  if low < -INT32_IDS or high >= INT32_IDS:
    bad = low if low < -INT32_IDS else high
    raise ValueError(
      f"{name} holds token id {bad}, past what int32 holds; ids must be >= 0 and < 2**31"
    )


def check_token_ids(tokens: np.ndarray, *, vocab_size: int | None, name: str) -> None:
  """Refuses ids outside [0, vocab_size) (only negative ones when the size is unknown): the
  embedding lookup inside jit would read a wrapped row for a negative id and NaN past the end,
  and generate from it without a word."""
  tokens = np.asarray(tokens)
  if tokens.size == 0:
    return
  low, high = int(tokens.min()), int(tokens.max())
  # Ids are int32 on device: a larger one would wrap (2**32 + 5 to 5, an id in the vocabulary).
  limit = vocab_size if vocab_size is not None else INT32_IDS
  if low < 0 or high >= limit:
    allowed = f"[0, {vocab_size - 1}]" if vocab_size is not None else ">= 0 and < 2**31"
    bad = low if low < 0 else high
    raise ValueError(f"{name} holds token id {bad}; ids must be {allowed} (the model's vocabulary)")


def check_row_lengths(tokens, lengths, *, vocab_size: int | None, name: str) -> None:
  """Rows as the caches take them: `tokens` integer [batch, width] with ids in the vocabulary
  and `lengths` integer [batch], each in [1, width]. Values are checked only where they are
  concrete (not inside a trace); a length past the width would prefill from padding the
  model never saw, and a zero length leaves no last token to predict from."""
  _dtype_of(tokens, name=name)  # nested lists: refused here if ragged
  _dtype_of(lengths, name="lengths")
  shape, lengths_shape = np.shape(tokens), np.shape(lengths)
  if len(shape) != 2 or lengths_shape != shape[:1]:
    raise ValueError(
      f"{name} must be [batch, width] and lengths [batch]; got {shape} and {lengths_shape}"
    )
  if shape[0] < 1 or shape[1] < 1:
    raise ValueError(f"{name} must hold at least one row and one token; got shape {shape}")
  values = _integer_values(lengths, name="lengths")
  if values is not None:
    if values.min() < 1 or values.max() > shape[1]:
      raise ValueError(
        f"lengths={values.tolist()} must each lie in [1, {shape[1]}] (the width of {name})"
      )
  check_token_array(tokens, vocab_size=vocab_size, name=name)


def check_positions(lengths, *, batch: int, name: str) -> None:
  """Per-row positions (`lengths`, `feed_lengths`): integer [batch], each >= 0 where concrete.
  A float one would make fractional cache slots that no write lands on, without an error."""
  if np.shape(lengths) != (batch,):
    raise ValueError(f"{name} must be [batch={batch}]; got shape {np.shape(lengths)}")
  values = _integer_values(lengths, name=name)
  if values is not None and values.size and (values.min() < 0 or values.max() >= INT32_IDS):
    raise ValueError(f"{name}={values.tolist()} must each be >= 0 and < 2**31")


def as_array(value, *, name: str):
  """`value` as an array where it is a (rectangular) nested list or tuple, which jit would
  otherwise take as a pytree of scalars; arrays and tracers pass through."""
  if isinstance(value, (list, tuple)):
    _dtype_of(value, name=name)  # ragged: refused naming `name`
    return np.asarray(value)
  return value


def _dtype_of(array, *, name: str):
  """The dtype `array` has or, for nested lists, would have as an array (ragged ones refused)."""
  if isinstance(array, (list, tuple)):
    try:
      return np.asarray(array).dtype
    except ValueError:
      raise ValueError(f"{name} must be rectangular: rows of equal length") from None
  return jax.numpy.result_type(array)


def _integer_values(array, *, name: str) -> np.ndarray | None:
  """`array`'s values, refused unless of an integer dtype; None inside a trace."""
  dtype = _dtype_of(array, name=name)
  if not np.issubdtype(dtype, np.integer):
    raise ValueError(f"{name} must hold integers; got dtype {dtype}")
  return None if isinstance(array, jax.core.Tracer) else np.asarray(array)


def check_token_array(tokens, *, vocab_size: int | None, name: str) -> None:
  """An array of token ids: of an integer dtype (a float one would be truncated), and
  `check_token_ids` where its values are concrete (not inside a trace)."""
  dtype = _dtype_of(tokens, name=name)
  if not np.issubdtype(dtype, np.integer):
    raise ValueError(f"{name} must hold integer token ids; got dtype {dtype}")
  if not isinstance(tokens, jax.core.Tracer):
    check_token_ids(np.asarray(tokens), vocab_size=vocab_size, name=name)
