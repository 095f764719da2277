import re
import runpy
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).parents[2] / "examples" / "compressed_generation.py"


@pytest.mark.slow
def test_every_compressed_cache_holds_fewer_bytes_than_the_full_one(capsys):
  runpy.run_path(str(EXAMPLE), run_name="__main__")
  out = capsys.readouterr().out
  assert re.search(r"prompt: (\d+) tokens", out)
  rows = re.findall(r"--- (\S+): ([\d.]+) MiB cache \(([\d.]+)x smaller than full\)", out)
  specs = [spec for spec, _, _ in rows]
  assert specs == ["full", "kivi:bits=4", "kivi", "snapkv:ratio=0.25+kivi:bits=4"]
  mib = {spec: float(m) for spec, m, _ in rows}
  ratio = {spec: float(r) for spec, _, r in rows}
  assert ratio["full"] == 1.0
  # Bits and tokens: 4-bit KIVI, then 2-bit, then a quarter of the tokens at 4 bits.
  assert 2.0 < ratio["kivi:bits=4"] < ratio["kivi"] < ratio["snapkv:ratio=0.25+kivi:bits=4"]
  for spec in specs:
    assert mib[spec] == pytest.approx(mib["full"] / ratio[spec], rel=0.01)
