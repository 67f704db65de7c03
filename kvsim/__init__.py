"""kvsim: how much of the GPU's KV-cache memory an allocation policy really uses."""

__version__ = "0.1.0"
