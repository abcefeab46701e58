"""_src.runtime."""
