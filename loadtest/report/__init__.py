"""Reports over sweep results: PNG plots (plots.py)."""
