"""The evaluation harness on a tiny random model (seconds, not minutes)."""

import dataclasses
import json
import math

import pytest

from kvjax.eval.compare import CompareConfig, compare_methods
from kvjax.eval.needle import answer_has_key
from kvjax.eval.report import write_results
from kvjax.sliding_window_cache import SlidingWindowLayerCache
from tests.kvjax.tiny_decoder import tiny_decoder


class CharTokenizer:
  """Bytes folded into the tiny vocabulary: enough to build needle prompts and decode digits."""

  vocab = 64

  def encode(self, text):
    return [ord(c) % self.vocab for c in text]

  def decode(self, ids):
    return "".join(chr(48 + i % 10) for i in ids)

  def apply_chat_template(self, messages, add_generation_prompt=True):
    return "".join(f"<{m['role']}>{m['content']}</s>" for m in messages) + (
      "<assistant>" if add_generation_prompt else ""
    )


@dataclasses.dataclass(frozen=True)
class LastTokenOnly:
  """Drops everything but the most recent token (a ring buffer of one slot)."""

  method_name = "last-token-only"

  def allocate(self, shape, layer, *, batch, prompt_len, max_new_tokens, dtype):
    return SlidingWindowLayerCache.zeros(
      batch=batch, kv_heads=shape.num_kv_heads, window=1, head_dim=shape.head_dim, dtype=dtype
    )


TEXT = "The quick brown fox jumps over the lazy dog. " * 40


@pytest.fixture(scope="module")
def records():
  decoder, params = tiny_decoder()
  config = CompareConfig(
    tasks=("ppl", "kl", "passkey", "passkey_agnostic", "speed"),
    context_len=48,
    continuation_len=16,
    num_samples=2,
  )
  return compare_methods(
    decoder, params, CharTokenizer(), ["full", LastTokenOnly()], text=TEXT, config=config
  )


def test_records_are_complete(records, tmp_path):
  assert [r["method"] for r in records] == ["full", "last-token-only"]
  keys = {
    "method",
    "cache_bytes",
    "cache_bytes_at_end",
    "full_cache_bytes",
    "compression_ratio",
    "bits_per_element",
    "ppl",
    "kl",
    "passkey_acc",
    "passkey_acc_by_depth",
    "prefill_s",
    "decode_tokens_per_s",
    "compile_s",
    "speed_batch",
  }
  for record in records:
    assert keys <= set(record)
    for key in keys - {"method", "passkey_acc_by_depth"}:
      assert isinstance(record[key], (int, float)) and math.isfinite(record[key]), key
    assert set(record["passkey_acc_by_depth"]) == {"0.1", "0.5", "0.9"}
  write_results(records, tmp_path)
  assert json.loads((tmp_path / "results.json").read_text())[0]["method"] == "full"
  assert (tmp_path / "quality_vs_memory.png").stat().st_size > 1000
  assert "| full |" in (tmp_path / "results.md").read_text()


def test_speed_is_timed_on_the_continuation_batch(records):
  for record in records:
    assert record["speed_batch"] == 2
    assert record["prefill_s"] > 0 and record["compile_s"] > 0
    assert record["decode_tokens_per_s"] > 0


def test_full_row_is_the_reference(records):
  full = records[0]
  assert full["kl"] == 0.0 and full["compression_ratio"] == 1.0
  # bf16 K and V of 2 layers x 2 KV heads x 48 tokens x 16 dims, plus int32 lengths.
  assert full["cache_bytes"] == 2 * (2 * 2 * 48 * 16 * 2 + 4)
  # At the end it also holds the 16 continuation tokens.
  assert full["cache_bytes_at_end"] == 2 * (2 * 2 * (48 + 16) * 16 * 2 + 4)
  assert full["bits_per_element"] == pytest.approx(16, rel=0.01)


def test_keeping_only_the_last_token_is_worse_and_smaller(records):
  full, last_only = records
  assert last_only["cache_bytes"] < full["cache_bytes"] / 10
  assert last_only["cache_bytes_at_end"] == last_only["cache_bytes"]  # its window never grows
  assert last_only["kl"] > 0.01
  assert last_only["ppl"] > full["ppl"]


def test_answer_parsing():
  assert answer_has_key(" 12345.", "12345")
  assert answer_has_key(": 1 2 3 4 5", "12345")
  assert not answer_has_key(" 12346", "12345")
  assert not answer_has_key(" none", "12345")


@pytest.mark.parametrize(
  "kwargs, message",
  [
    (dict(tasks=("ppl", "bleu")), r"has unknown \['bleu'\]; allowed: ppl,kl"),
    (dict(tasks=()), "tasks is empty; allowed: ppl,kl"),
    (dict(context_len=0), "context_len"),
    (dict(cache_dtype="int8"), "cache_dtype"),
  ],
)
def test_bad_config_errors(kwargs, message):
  with pytest.raises(ValueError, match=message):
    CompareConfig(**kwargs)


def test_bad_method_spec_errors_before_any_work():
  decoder, params = tiny_decoder()
  with pytest.raises(ValueError, match="unknown cache method 'magic'"):
    compare_methods(
      decoder, params, CharTokenizer(), ["magic:x=1"], text=TEXT, config=CompareConfig()
    )


def test_text_too_short_errors():
  decoder, params = tiny_decoder()
  with pytest.raises(ValueError, match="too short"):
    compare_methods(
      decoder,
      params,
      CharTokenizer(),
      ["full"],
      text="tiny",
      config=CompareConfig(tasks=("ppl",), context_len=8, continuation_len=4),
    )
