"""hf_layerswap: protocol-aware layer redundancy (replacement and interchange swap-KL),
decoder-layer removal at ``from_pretrained`` time, and publishing with the evidence."""

__version__ = "0.1.0"
