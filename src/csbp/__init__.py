"""csbp: context-sharded block parallelism for block-diffusion language models."""

__version__ = "0.1.0"
