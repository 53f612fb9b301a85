"""tandem: speculative decoding with draft and target models as separate, independently scaled services."""

__version__ = "0.1.0"
