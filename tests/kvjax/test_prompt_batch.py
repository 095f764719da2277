import numpy as np
import pytest

from kvjax.prompt_batch import compact_padded_batch, pack_prompts


def test_pack_prompts_right_pads():
  tokens, lengths = pack_prompts([[5, 6, 7], [8]], pad_token_id=0)
  np.testing.assert_array_equal(tokens, [[5, 6, 7], [8, 0, 0]])
  np.testing.assert_array_equal(lengths, [3, 1])


@pytest.mark.parametrize("side", ["left", "right"])
def test_compact_padded_batch_accepts_either_padding_side(side):
  real = [[1, 2, 3, 4], [9, 8]]
  width = 4
  tokens = np.zeros((2, width), int)
  mask = np.zeros((2, width), int)
  for row, ids in enumerate(real):
    span = slice(width - len(ids), width) if side == "left" else slice(0, len(ids))
    tokens[row, span] = ids
    mask[row, span] = 1
  compact, lengths = compact_padded_batch(tokens, mask)
  np.testing.assert_array_equal(compact, [[1, 2, 3, 4], [9, 8, 0, 0]])
  np.testing.assert_array_equal(lengths, [4, 2])


@pytest.mark.parametrize("mask", [[[1, 0, 1]], [[0, 0, 0]]], ids=["holes", "empty"])
def test_compact_padded_batch_rejects_bad_masks(mask):
  with pytest.raises(ValueError, match="attention_mask row 0"):
    compact_padded_batch(np.ones((1, 3), int), np.array(mask))


@pytest.mark.parametrize("value", [-1, 2, 0.5])
def test_mask_values_other_than_zero_and_one_are_refused(value):
  """Any nonzero value would mark a real token: -1 or 0.5 over a padding token would feed it."""
  mask = np.array([[value, 1, 1]])
  with pytest.raises(ValueError, match=f"attention_mask holds {value}; it must hold only 0 and 1"):
    compact_padded_batch(np.array([[0, 5, 6]]), mask)


def test_boolean_masks_are_taken():
  compact, lengths = compact_padded_batch(np.array([[0, 5, 6]]), np.array([[False, True, True]]))
  np.testing.assert_array_equal(compact, [[5, 6]])
  np.testing.assert_array_equal(lengths, [2])


def test_empty_prompt_rejected():
  with pytest.raises(ValueError, match="at least one token"):
    pack_prompts([[1], []])


def test_ids_that_are_not_ints_are_refused_not_truncated():
  with pytest.raises(
    ValueError, match=r"prompts\[1\] must be a list of int token ids, got \[2.5\]"
  ):
    pack_prompts([[1], [2.5]])


@pytest.mark.parametrize("pad", [None, 1.7, "0", True, 2**40])
def test_a_pad_token_id_that_is_not_an_int_id_is_refused_by_name(pad):
  # A Llama tokenizer's pad_token_id is None; 1.7 was truncated to 1 without a word.
  message = "pad_token_id" + (" holds token id" if pad == 2**40 else "=.* must be an int token id")
  with pytest.raises(ValueError, match=message):
    pack_prompts([[1, 2], [3]], pad_token_id=pad)
  with pytest.raises(ValueError, match=message):
    compact_padded_batch(np.ones((1, 2), np.int32), np.ones((1, 2)), pad_token_id=pad)


def test_a_padded_batch_of_floats_or_ragged_rows_is_refused_by_its_own_names():
  with pytest.raises(ValueError, match="tokens must hold int token ids, got dtype float64"):
    compact_padded_batch(np.ones((1, 2)), np.ones((1, 2)))
  with pytest.raises(ValueError, match="tokens and attention_mask must be rectangular"):
    compact_padded_batch([[1, 2], [3]], [[1, 1], [1]])
