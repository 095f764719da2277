"""Evaluation against the full cache: continuation perplexity and KL, needle retrieval,
true cache bytes, speed; and `compare`, which runs them for many methods."""
