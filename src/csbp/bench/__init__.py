"""Benchmarks that anyone can rerun with one command: attention layouts, training steps, drafters."""
