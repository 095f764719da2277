"""Flax NNX Llama-family decoders (Llama, SmolLM, Mistral) and offline weight/tokenizer loading."""
