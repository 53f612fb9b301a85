"""Model registry, downloads, conversion, tiny test models and loading."""
