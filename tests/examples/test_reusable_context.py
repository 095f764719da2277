import re
import runpy
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).parents[2] / "examples" / "reusable_context.py"


@pytest.mark.slow
def test_a_saved_and_restored_compressed_context_answers_like_the_one_in_memory(
  capsys, monkeypatch, tmp_path
):
  directory = tmp_path / "try_statement"
  monkeypatch.setattr(sys, "argv", [str(EXAMPLE), "--directory", str(directory)])
  runpy.run_path(str(EXAMPLE), run_name="__main__")
  out = capsys.readouterr().out
  cache, full, ratio = map(
    float,
    re.search(r"cache ([\d.]+) MiB \(full cache ([\d.]+) MiB, ([\d.]+)x smaller", out).groups(),
  )
  assert ratio > 2.5 and cache == pytest.approx(full / ratio, rel=0.01)
  disk = float(re.search(r"([\d.]+) MiB on disk", out).group(1))
  # The checkpoint holds the compressed arrays (orbax compresses them a little), not K/V.
  assert disk < cache * 1.05
  assert directory.is_dir()
  assert out.count("(same answer from the context in memory: True)") == 2
  assert re.search(r"2 questions one at a time: [\d.]+ s", out)
  repeated = re.search(
    r"in one batch \(repeat_context\): [\d.]+ s, caches ([\d.]+) MiB; same answers: True", out
  )
  shared = re.search(r"in one batch \(share_context\): [\d.]+ s, caches ([\d.]+) MiB", out)
  # Two copies of the context, against one and two rows of 48 answer tokens and a question.
  assert float(repeated.group(1)) == pytest.approx(2 * cache, rel=0.01)
  assert cache < float(shared.group(1)) < float(repeated.group(1))
  assert out.count("A (share_context): ") == 2
