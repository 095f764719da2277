"""`benchmarks/gpu_session.sh`'s next steps, run here with a stand-in for the device's python3:
every kernel config a step hands a script passes the GPU entry point's own check
(`check_config`), and every script is called with flags it has. A config string broken by a
refactor would otherwise cost a GPU session's minutes before anything ran."""

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parents[2]
# Checks what a script would be given and runs nothing: configs through `check_config`, flags
# through the script's own parser (its --help); pytest is only named; a sweep's --out gets rows of
# made-up seconds, the first config fastest, for the steps' pick of the fastest.
STAND_IN = """
import json, os, re, subprocess, sys
sys.path.insert(0, {root!r})
from pallas_kernels.quantized_decode_attention_gpu import check_config
args = sys.argv[1:]
if args[:1] == ["-m"]:
  print("stand-in: pytest not run")
  sys.exit(0)
if args[:1] == ["-c"]:  # the steps' own one-liners (keep_fastest's pick) run as they are
  sys.exit(subprocess.run([{python!r}, *args]).returncode)
script = args[0]
usage = subprocess.run(
  [{python!r}, script, "--help"], capture_output=True, text=True, check=True,
  env={{"PYTHONPATH": {root!r}}}, cwd={root!r},
).stdout
for flag in (a.split("=")[0] for a in args[1:] if a.startswith("--")):
  # the whole flag: "--sweep" is not found in "--sweep-configs"
  if not re.search(re.escape(flag) + r"(?![\\w-])", usage):
    sys.exit(f"{{script}} has no flag {{flag}}")
for flag in (
  "--sweep-configs", "--kernel-config", "--kivi-settings", "--folded-mosaic-kernel-config"
):
  if flag in args:
    configs = json.loads(args[args.index(flag) + 1])
    configs = configs if isinstance(configs, list) else [configs]
    for config in configs:
      check_config(config)
    print(f"sweep kivi checked {{script}} {{len(configs)}}")
    if "--out" in args and flag == "--sweep-configs":  # what keep_fastest reads
      wrong_first = os.environ.get("STAND_IN_FIRST_WRONG") == "1"
      rows = [
        dict(config=c, seconds=1.0 + i, wrong=wrong_first and i == 0)
        for i, c in enumerate(configs)
      ]
      with open(args[args.index("--out") + 1], "w") as out:
        json.dump(dict(sweep_kivi2=rows), out)
"""


@pytest.fixture
def stand_in(tmp_path):
  """(environment, python): gpu_session.sh's environment with the stand-in as its python and a
  stand-in nvidia-smi on PATH."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  script = tmp_path / "stand_in.py"
  script.write_text(STAND_IN.format(root=str(ROOT), python=sys.executable))
  python = bin_dir / "python3"
  python.write_text(f'#!/usr/bin/env bash\nexec "{sys.executable}" "{script}" "$@"\n')
  smi = bin_dir / "nvidia-smi"
  smi.write_text("#!/usr/bin/env bash\necho 'stand-in GPU'\n")
  for path in (python, smi):
    path.chmod(0o755)
  environment = dict(
    os.environ,
    PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
    PYTHON=str(python),
    OUT=str(tmp_path / "out"),
  )
  return environment, python


def _checked_configs(out: pathlib.Path) -> list[tuple[str, int]]:
  """(script, number of configs) of every check in the step's logs, sorted."""
  logs = "".join(path.read_text() for path in sorted(out.glob("*.log")))
  return sorted(
    (script, int(count)) for script, count in re.findall(r"sweep kivi checked (\S+) (\d+)", logs)
  )


def _run_step(environment: dict, step: str) -> tuple[pathlib.Path, str]:
  """(its $OUT, its stdout) of `gpu_session.sh step` run with the stand-in, which must succeed."""
  run = subprocess.run(
    ["bash", "benchmarks/gpu_session.sh", step],
    cwd=ROOT,
    env=environment,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert run.returncode == 0, run.stdout + run.stderr
  return pathlib.Path(environment["OUT"]), run.stdout


SWEEP = "benchmarks/decode_attention.py"


@pytest.mark.parametrize(
  "step,expected",
  [
    # (The steps run before v59, 10-14 s each, under -m slow; v60 and v61 are the next ones.)
    # 32k sweep (11 configs), KIVI-4 (3), 8 query heads per KV head (2)
    pytest.param("warp_products", [(SWEEP, 2), (SWEEP, 3), (SWEEP, 11)], marks=pytest.mark.slow),
    # head_dim 64, KIVI-2 and KIVI-4 (4 configs each)
    pytest.param("warp_head_dim64", [(SWEEP, 4), (SWEEP, 4)], marks=pytest.mark.slow),
    # the generate check with C + merge + matrix loads, the 32k sweep (9), its fastest picked
    pytest.param(
      "v43",
      [("benchmarks/generate_kernels_check.py", 1), (SWEEP, 9)],
      marks=pytest.mark.slow,
    ),
    # every attention call through two kernels, teacher-forced logits through one, then the 8k
    # and 128k tables (the Triton config and the warp one each)
    (
      "v60",
      [("benchmarks/attention_calls_check.py", 1)] * 2
      + [("benchmarks/generate_logit_margins.py", 1)]
      + [(SWEEP, 1)] * 4,
    ),
    # the 32k sweep around warp V59 with the warp defaults as the control (8 configs), the table
    # with the fastest (then the native tests, which the stand-in does not run)
    ("v61", [(SWEEP, 8), (SWEEP, 1), (SWEEP, 1)]),
  ],
)
def test_the_next_steps_hand_their_scripts_valid_configs_and_flags(stand_in, step, expected):
  environment, _ = stand_in
  out, stdout = _run_step(environment, step)
  assert _checked_configs(out) == sorted(expected), stdout


def test_the_fastest_config_picked_is_never_a_wrong_one(stand_in):
  """`keep_fastest` skips a config the sweep found wrong (its output past the reference's limit,
  `decode_attention.SWEEP_ERROR_LIMIT`), however fast: v61's table gets the second config."""
  environment, _ = stand_in
  out, _ = _run_step(dict(environment, STAND_IN_FIRST_WRONG="1"), "v61")
  rows = json.loads((out / "sweep_32k.json").read_text())["sweep_kivi2"]
  assert rows[0]["wrong"] and rows[0]["seconds"] < rows[1]["seconds"]
  picked = re.search(r"fastest at 32k: (.*)", (out / "v61.log").read_text()).group(1)
  assert json.loads(picked) == rows[1]["config"]


def test_the_stand_in_refuses_a_bad_config_and_an_unknown_flag(stand_in):
  _, python = stand_in
  bad_config = json.dumps([{"lowering": "mosaic_gpu", "variant": "warp", "num_stages": 9}])
  for arguments in (
    ["--sweep", "--sweep-configs", bad_config],
    ["--sweep", "--no-such-flag"],
    ["--sweep", "--sweep-config", "[]"],  # a prefix of --sweep-configs is not that flag
  ):
    run = subprocess.run(
      [str(python), "benchmarks/decode_attention.py", *arguments],
      cwd=ROOT,
      capture_output=True,
      text=True,
      timeout=120,
    )
    assert run.returncode != 0, arguments
