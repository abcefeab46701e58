"""_src.autodiff."""
