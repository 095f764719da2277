"""Generate with the embedded SmolLM2 under several KV-cache methods and compare their bytes.

python examples/compressed_generation.py
"""

import jax.numpy as jnp

import kvjax
from models.loading import load_model


def main():
  model = load_model("smollm2-135m")
  question = "Explain in two sentences why the sky is blue."
  prompt = model.tokenizer.apply_chat_template([{"role": "user", "content": question}])
  prompt_ids = model.tokenizer.encode(prompt)
  for spec in ("full", "kivi:bits=4", "kivi:bits=2,residual=32"):
    if not all(part.split(":")[0] in kvjax.METHODS for part in spec.split("+")):
      continue
    result = kvjax.generate(
      model.decoder,
      model.params,
      [prompt_ids],
      max_new_tokens=48,
      cache_method=kvjax.parse_method_spec(spec),
      cache_dtype=jnp.bfloat16,
      stop_token_ids=model.stop_token_ids,
    )
    text = model.tokenizer.decode(result.token_lists()[0])
    print(
      f"--- {spec}: {result.cache_bytes / 1024:.0f} KiB cache, "
      f"{result.decode_tokens_per_s:.1f} tok/s\n{text}\n"
    )


if __name__ == "__main__":
  main()
