"""_src.collectives."""
