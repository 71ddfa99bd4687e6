"""The device check (``make gpu-check``): CUDA tests, NCCL verification and a single-GPU training
table with model FLOP utilisation (``check``, ``train_table``, ``flops``)."""
