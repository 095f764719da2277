import json
import re
import runpy
from pathlib import Path

EXAMPLE = Path(__file__).parents[2] / "examples" / "own_model_protocol.py"


def test_the_toy_model_generates_through_a_full_and_a_kivi_cache_and_in_chunks(capsys):
  runpy.run_path(str(EXAMPLE), run_name="__main__")
  lines = capsys.readouterr().out.strip().splitlines()
  printed = {}
  for line in lines:
    match = re.fullmatch(r"(\S+) (\[\[.*\]\]) (\d+) bytes", line)
    assert match, line
    printed[match[1]] = (json.loads(match[2]), int(match[3]))
  assert list(printed) == [
    "full",
    "full,prefill_chunk=16",
    "kivi:bits=4,group_size=16,residual=16",
  ]
  # A full cache attends exactly whether the prompt comes in one piece or in chunks.
  assert printed["full,prefill_chunk=16"] == printed["full"]
  for tokens, _ in printed.values():
    assert len(tokens) == 2 and all(len(row) == 8 for row in tokens)  # 2 prompts, 8 new tokens
  # 56 tokens per row: three quantized blocks of 16 at 4 bits plus a 16-slot window.
  assert printed["kivi:bits=4,group_size=16,residual=16"][1] < printed["full"][1] / 1.5
