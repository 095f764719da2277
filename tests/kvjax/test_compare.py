"""The evaluation harness on a tiny random model (seconds, not minutes)."""

import dataclasses
import json
import math
import types

import numpy as np
import pytest

from kvjax.eval import compare as compare_module
from kvjax.eval import speed
from kvjax.eval.compare import CompareConfig, compare_methods
from kvjax.eval.continuation import ContinuationScores, special_prefix
from kvjax.eval.needle import answer_has_key
from kvjax.eval.report import write_results
from kvjax.kivi_cache import Kivi
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
    context_len=448,  # the needle prompt's fixed text takes ~390 of this tokenizer's tokens
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
  assert full["compression_ratio"] == 1.0  # (its kl is 0.0 by definition, not a measurement)
  # bf16 K and V of 2 layers x 2 KV heads x 448 tokens x 16 dims, plus int32 lengths.
  assert full["cache_bytes"] == 2 * (2 * 2 * 448 * 16 * 2 + 4)
  # At the end it also holds the 16 continuation tokens.
  assert full["cache_bytes_at_end"] == 2 * (2 * 2 * (448 + 16) * 16 * 2 + 4)
  assert full["bits_per_element"] == pytest.approx(16, rel=0.01)


def test_full_is_the_reference_wherever_it_is_listed(records):
  decoder, params = tiny_decoder()
  config = CompareConfig(tasks=("ppl", "kl"), context_len=448, continuation_len=16, num_samples=2)
  reordered = compare_methods(
    decoder, params, CharTokenizer(), [LastTokenOnly(), "full"], text=TEXT, config=config
  )
  assert [r["method"] for r in reordered] == [r["method"] for r in records]
  for record, expected in zip(reordered, records, strict=True):
    for field in ("cache_bytes", "full_cache_bytes", "compression_ratio", "ppl", "kl"):
      assert record[field] == pytest.approx(expected[field], rel=1e-6), field


def test_keeping_only_the_last_token_is_worse_and_smaller(records):
  full, last_only = records
  assert last_only["cache_bytes"] < full["cache_bytes"] / 10
  assert last_only["cache_bytes_at_end"] == last_only["cache_bytes"]  # its window never grows
  assert last_only["kl"] > 0.01
  assert last_only["ppl"] > full["ppl"]


def test_the_prefill_is_timed_after_an_unmeasured_run_as_a_median(monkeypatch):
  """On a clock the program advances itself (no real time is asserted: DESIGN.md keeps timings
  out of unit tests): its first run takes 300, later ones 10, 20, 30."""
  now, calls = [0.0], []

  def program(x):  # its first run is slow, as a compiled program's setup can be
    calls.append(x)
    now[0] += 300.0 if len(calls) == 1 else 10.0 * (len(calls) - 1)
    return x

  class Jitted:
    def lower(self, decoder, *args, **kwargs):
      now[0] += 7.0  # compiling
      return types.SimpleNamespace(compile=lambda: program)

  monkeypatch.setattr(speed.time, "perf_counter", lambda: now[0])
  out, compile_s, run_s = speed._compile_and_run(
    Jitted(), None, (1,), {}, timed_runs=speed.PREFILL_TIMED_RUNS
  )
  assert out == 1 and len(calls) == 1 + speed.PREFILL_TIMED_RUNS == 4
  assert (compile_s, run_s) == (7.0, 20.0)  # the median of 10, 20, 30
  _, _, single = speed._compile_and_run(Jitted(), None, (1,), {})
  assert single == 40.0 and len(calls) == 2 + speed.PREFILL_TIMED_RUNS


def test_kl_is_of_the_full_cache_to_the_method_averaged_over_positions():
  rng = np.random.default_rng(0)
  log_softmax = lambda x: x - np.log(np.exp(x).sum(-1, keepdims=True))
  full, method = (log_softmax(rng.normal(size=(3, 5, 7))).astype(np.float32) for _ in range(2))
  targets = np.zeros((3, 5), np.int32)
  kl = ContinuationScores(method, targets).kl_from(ContinuationScores(full, targets))
  expected = np.mean(np.sum(np.exp(full) * (full - method), axis=-1))
  reverse = np.mean(np.sum(np.exp(method) * (method - full), axis=-1))
  assert kl == pytest.approx(expected, rel=1e-6) and kl != pytest.approx(reverse, rel=1e-3)


class BosCharTokenizer(CharTokenizer):
  """A tokenizer that adds BOS and EOS around a text when asked, as Llama's do (ids 63 and 62,
  which no character of TEXT maps to)."""

  def encode(self, text, add_special_tokens=False):
    ids = super().encode(text)
    return [63] + ids + [62] if add_special_tokens else ids


def test_scored_windows_start_with_the_bos_the_tokenizer_adds(monkeypatch):
  assert special_prefix(CharTokenizer()) == []  # encode takes no add_special_tokens
  assert special_prefix(BosCharTokenizer()) == [63]
  seen = []
  scored = compare_module._continuation_and_speed

  def spy(decoder, params, method, windows, *args):
    seen.append(windows)
    return scored(decoder, params, method, windows, *args)

  monkeypatch.setattr(compare_module, "_continuation_and_speed", spy)
  decoder, params = tiny_decoder()
  config = CompareConfig(tasks=("ppl",), context_len=40, continuation_len=8, num_samples=2)
  compare_methods(decoder, params, BosCharTokenizer(), ["full"], text=TEXT, config=config)
  (windows,) = seen
  assert windows.shape == (2, 48)
  assert (windows[:, 0] == 63).all() and (windows[:, 1:] != 63).all()


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
    (dict(seed=-1), "seed=-1 must be an int >= 0"),
    (dict(cache_dtype="int8"), "cache_dtype"),
    (dict(needle_lengths=[1024]), r"needle_lengths=\[1024\] must be a tuple of token counts"),
    (dict(needle_lengths=(1024, 0)), r"needle_lengths\[1\]=0 must be an int >= 1"),
    (dict(needle_lengths=(1024, 2048, 1024)), "lists a length twice; list each once"),
    (dict(tasks=("ppl", "kl"), needle_lengths=(1024,)), "tasks=ppl,kl runs no needle; add passkey"),
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


def test_a_context_too_short_for_the_needle_prompt_errors():
  decoder, params = tiny_decoder()
  with pytest.raises(ValueError, match=r"context_len=48 is too short for the needle task"):
    compare_methods(
      decoder,
      params,
      CharTokenizer(),
      ["full"],
      text=TEXT,
      config=CompareConfig(tasks=("passkey",), context_len=48, continuation_len=4),
    )


def test_a_needle_length_too_short_or_too_long_is_refused_by_its_place_before_any_run(
  monkeypatch,
):
  decoder, params = tiny_decoder()
  monkeypatch.setattr(compare_module, "run_needle", lambda *a, **k: pytest.fail("a needle ran"))

  def run(lengths, max_context=None):
    config = CompareConfig(tasks=("passkey",), context_len=448, needle_lengths=lengths)
    compare_methods(
      decoder, params, CharTokenizer(), ["full"], text=TEXT, config=config, max_context=max_context
    )

  with pytest.raises(ValueError, match=r"needle_lengths\[1\]=48 is too short for the needle"):
    run((448, 48))
  with pytest.raises(ValueError, match=r"needle_lengths\[1\] 480 \+ the needle's 8 answer tokens"):
    run((448, 480), max_context=470)


def test_a_needle_asked_at_several_lengths_scores_each_as_a_run_of_its_own(records, monkeypatch):
  """Each length's prompts are about that long, its answers are those a run at that length alone
  gives (the records fixture: context_len 448), and the columns hold all lengths together."""
  prompt_lengths = {}
  run_needle = compare_module.run_needle

  def spy(decoder, params, tokenizer, method, prompts, **kwargs):
    widths = {len(p.context_ids) + len(p.question_ids) for p in prompts}
    prompt_lengths.setdefault(kwargs["query_aware"], []).append(widths)
    return run_needle(decoder, params, tokenizer, method, prompts, **kwargs)

  monkeypatch.setattr(compare_module, "run_needle", spy)
  decoder, params = tiny_decoder()
  config = CompareConfig(
    tasks=("passkey", "passkey_agnostic"),
    context_len=448,
    num_samples=2,
    needle_lengths=(448, 540),
  )
  full, last_only = compare_methods(
    decoder, params, CharTokenizer(), ["full", LastTokenOnly()], text=TEXT, config=config
  )
  for widths_by_run in prompt_lengths.values():
    # two methods, each at 448 then 540; the filler comes in units of 91 characters (tokens)
    assert len(widths_by_run) == 4
    for widths, length in zip(widths_by_run, [448, 540, 448, 540]):
      assert all(length - 91 < w <= length for w in widths), (widths, length)
  for record, alone in ((full, records[0]), (last_only, records[1])):
    assert record["cache_bytes"] == alone["cache_bytes"]  # the bytes stay context_len's
    for task in ("passkey", "passkey_agnostic"):
      by_length = record[f"{task}_acc_by_length"]
      assert list(by_length) == ["448", "540"]
      assert by_length["448"]["accuracy"] == alone[f"{task}_acc"]
      assert by_length["448"]["by_depth"] == alone[f"{task}_acc_by_depth"]
      assert record[f"{task}_answers"][:6] == alone[f"{task}_answers"]
      assert len(record[f"{task}_answers"]) == 12
      accuracies = [r["accuracy"] for r in by_length.values()]
      assert record[f"{task}_acc"] == pytest.approx(sum(accuracies) / 2)
      for depth, accuracy in record[f"{task}_acc_by_depth"].items():
        assert accuracy == pytest.approx(sum(r["by_depth"][depth] for r in by_length.values()) / 2)


def test_the_table_shows_each_needle_length_where_there_are_several():
  from kvjax.eval.report import format_table

  depths = {"0.1": 1.0, "0.5": 0.5, "0.9": 0.0}
  one = dict(method="a", passkey_acc=0.5, passkey_acc_by_depth=depths)
  one["passkey_acc_by_length"] = {"1024": dict(accuracy=0.5, by_depth=depths)}
  several = dict(one, method="b", passkey_acc=0.25)
  several["passkey_acc_by_length"] = {
    "1024": dict(accuracy=0.5, by_depth=depths),
    "2048": dict(accuracy=0.0, by_depth=dict.fromkeys(depths, 0.0)),
  }
  table = format_table([one, several], markdown=True)
  assert "| a | 0.50 (1.00/0.50/0.00) |" in table
  assert "| b | 0.25 (1024: 0.50, 2048: 0.00) |" in table


def test_a_method_listed_twice_is_refused():
  """A repeat would time a program already compiled, and a second full would be its own KL
  reference."""
  decoder, params = tiny_decoder()
  for specs in (
    ["streaming:budget=32", "streaming:budget=32"],
    ["full", "full"],
    # one method, other implementations: two rows of one name
    [Kivi(bits=4, implementation="reference"), Kivi(bits=4, implementation="interpret")],
  ):
    with pytest.raises(ValueError, match="method_specs lists .* twice; list each method once"):
      config = CompareConfig(tasks=("ppl",), context_len=40, continuation_len=8)
      compare_methods(decoder, params, CharTokenizer(), specs, text=TEXT, config=config)


def test_one_razor_profile_by_two_paths_is_one_method_listed_twice(profile_path, tmp_path):
  copy = tmp_path / "copy.json"
  copy.write_text(open(profile_path).read())
  decoder, params = tiny_decoder()
  specs = [f"razor:budget=12,profile={profile_path}", f"razor:budget=12,profile={copy}"]
  config = CompareConfig(tasks=("ppl",), context_len=40, continuation_len=8)
  with pytest.raises(ValueError, match="method_specs lists razor.* twice"):
    compare_methods(decoder, params, CharTokenizer(), specs, text=TEXT, config=config)


def test_a_needle_only_run_needs_room_for_the_answer_not_the_continuation():
  decoder, params = tiny_decoder()
  needle_only = CompareConfig(tasks=("passkey",), context_len=448, continuation_len=256)

  def run(config, max_context):
    return compare_methods(
      decoder, params, CharTokenizer(), ["full"], text=TEXT, config=config, max_context=max_context
    )

  (full,) = run(needle_only, 460)
  assert full["passkey_acc"] is not None and full["cache_bytes_at_end"] is None
  with pytest.raises(ValueError, match="context_len 448 \\+ the needle's 8 answer tokens"):
    run(needle_only, 450)
  with pytest.raises(ValueError, match="context_len 448 \\+ continuation_len 256 exceeds"):
    run(dataclasses.replace(needle_only, tasks=("passkey", "ppl")), 460)


def test_a_nan_result_prints_as_nan_not_as_not_measured():
  from kvjax.eval.report import format_table

  table = format_table(
    [
      dict(method="broken", cache_bytes=2**20, ppl=float("nan")),
      dict(method="x", cache_bytes=2**20),
    ]
  )
  broken, unmeasured = table.splitlines()[-2:]
  assert "nan" in broken and "nan" not in unmeasured


@pytest.mark.parametrize(
  "tasks, message",
  [
    (("ppl",), r"too short for 3 windows.*\(lower --num-samples or"),
    # A speed run takes one window whatever --num-samples says.
    (("speed",), r"too short for 1 windows.*\(lower --context-len or"),
  ],
)
def test_text_too_short_errors(tasks, message):
  decoder, params = tiny_decoder()
  with pytest.raises(ValueError, match=message):
    compare_methods(
      decoder,
      params,
      CharTokenizer(),
      ["full"],
      text="tiny",
      config=CompareConfig(tasks=tasks, context_len=8, continuation_len=4, num_samples=3),
    )


@pytest.mark.parametrize("tasks", [("ppl",), ("kl",), ("speed",)])
def test_a_tokenizer_with_ids_past_the_vocabulary_is_refused_before_any_work(tasks, monkeypatch):
  # The continuation tasks run lowered programs, which skip generate's checks: the KL came out
  # NaN, the speed was timed on garbage and the perplexity raised an IndexError.
  class WideTokenizer(CharTokenizer):
    def encode(self, text):
      return [ord(c) % 128 for c in text]

  monkeypatch.setattr(
    compare_module, "timed_prefill", lambda *a, **k: pytest.fail("ran before the check")
  )
  decoder, params = tiny_decoder()
  message = r"the tokenized text holds token id \d+; ids must be \[0, 63\]"
  with pytest.raises(ValueError, match=message):
    compare_methods(
      decoder,
      params,
      WideTokenizer(),
      ["full", "streaming:budget=8"],
      text=TEXT,
      config=CompareConfig(tasks=tasks, context_len=16, continuation_len=4, num_samples=1),
    )


def test_no_continuation_to_score_is_refused():
  from kvjax.eval.continuation import score_continuation

  decoder, params = tiny_decoder()
  windows = np.ones((2, 16), np.int32)
  with pytest.raises(ValueError, match="context_len=16 leaves no continuation in windows of 16"):
    score_continuation(decoder, params, "full", windows, context_len=16)


def test_results_json_is_strict_json_and_the_plot_shows_every_accuracy(tmp_path, monkeypatch):
  from kvjax.eval import report

  records = [
    dict(method="full", cache_bytes=2**20, kl=0.0, passkey_agnostic_acc=1.0),
    dict(method="bad", cache_bytes=2**19, kl=float("nan"), passkey_agnostic_acc=0.5),
    dict(method="worse", cache_bytes=2**18, kl=float("inf"), passkey_agnostic_acc=0.0),
  ]
  plotted = []
  monkeypatch.setattr(report, "plot_quality_vs_memory", lambda r, path: plotted.append(r))
  write_results(records, tmp_path)
  # Bare NaN / Infinity are not JSON: jq and JavaScript refuse them. They are written as null.
  loaded = json.loads(
    (tmp_path / "results.json").read_text(),
    parse_constant=lambda name: pytest.fail(f"{name} written"),
  )
  assert [r["kl"] for r in loaded] == [0.0, None, None]
  assert "nan" in (tmp_path / "results.md").read_text()  # the table still says what it was
  monkeypatch.undo()
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  figures, close = [], plt.close
  monkeypatch.setattr(plt, "close", figures.append)
  report.plot_quality_vs_memory(records, tmp_path / "p.png")
  # A run of the query-agnostic needle alone drew an empty plot.
  assert [axis.get_ylabel() for axis in figures[0].axes] == [
    "KL(full || method)",
    "needle accuracy (query-agnostic)",
  ]
  close(figures[0])


def test_the_machine_line_counts_the_cpus_this_process_may_use(monkeypatch):
  from kvjax.eval import machine

  # Under taskset (or a container's CPU set) the results are of fewer CPUs than the host has.
  monkeypatch.setattr(machine.os, "sched_getaffinity", lambda pid: {3})
  monkeypatch.setattr(machine.os, "cpu_count", lambda: 64)
  assert ", 1 CPUs; jax " in machine.machine_description()
