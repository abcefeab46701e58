"""_src.arrays."""
