"""_src.tree."""
