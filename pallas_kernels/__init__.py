"""Pallas decode-attention kernels beside their pure-jnp references.

Arrays in, arrays out: nothing here knows about caches or models, and only jax is imported.
"""
