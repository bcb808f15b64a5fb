"""The training loss's chunk (``train.lm_loss``): fp32 logits upcast at once. Torch-free, for the
memory model (``sim.memory``) too."""

LOSS_CHUNK_ELEMENTS = 1 << 25  # 128 MiB of fp32: one chunk's temporaries
