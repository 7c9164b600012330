"""vtdense: hierarchical vision transformers for dense prediction."""

__version__ = "0.1.0.dev0"
