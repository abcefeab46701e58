"""Floor 4: ``value_and_grad`` (vma-aware, overlapped reductions) and ``remat`` with its policies."""
