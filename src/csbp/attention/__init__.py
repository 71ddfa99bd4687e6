"""Attention: row metadata, kernels, online-softmax merge, per-rank layouts and distributed transports."""
