"""Floor 3: collective primitives (autograd Functions with their forward, backward, jvp, vmap and vma rules),
varying-axes tracking (the only code that reads or writes vma tags), and ``lax``, the user-facing collectives."""
