"""Answer a question about a ~2k-token document with the embedded SmolLM2 under several KV-cache
methods, and compare what each cache holds.

python examples/compressed_generation.py

The document is CPython's reference text for the `try` statement (shipped with Python, read
offline). The caches are allocated for the prompt plus the new tokens, so the bytes printed are
what each method really holds for this generation. A cache for fewer tokens than KIVI's residual
window (128) holds everything in full precision and saves nothing: compression shows on long
contexts like this one.
"""

from pydoc_data.topics import topics

import jax.numpy as jnp

import kvjax
from models.loading import load_model

SPECS = ("full", "kivi:bits=4", "kivi", "snapkv:ratio=0.25+kivi:bits=4")


def main():
  model = load_model("smollm2-135m")
  question = "In one sentence: when does the finally clause of a try statement run?"
  content = f"{topics['try']}\n\n{question}"
  prompt = model.tokenizer.apply_chat_template([{"role": "user", "content": content}])
  prompt_ids = model.tokenizer.encode(prompt)
  print(f"prompt: {len(prompt_ids)} tokens\n")
  full_bytes = None
  for spec in SPECS:
    result = kvjax.generate(
      model.decoder,
      model.params,
      [prompt_ids],
      max_new_tokens=48,
      cache_method=kvjax.parse_method_spec(spec),
      cache_dtype=jnp.bfloat16,
      stop_token_ids=model.stop_token_ids,
    )
    full_bytes = full_bytes or result.cache_bytes
    text = model.tokenizer.decode(result.token_lists()[0])
    print(
      f"--- {spec}: {result.cache_bytes / 2**20:.2f} MiB cache "
      f"({full_bytes / result.cache_bytes:.2f}x smaller than full), "
      f"{result.decode_tokens_per_s:.1f} tok/s\n{text}\n"
    )


if __name__ == "__main__":
  main()
