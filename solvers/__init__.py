"""Solvers: the intra-op sharding ILP and the inter-op DPs; plain data in and out, no JAX."""
