"""Floor 1, pure data: pytrees with paths, ``P`` and shard arithmetic, spec rules, precision policies."""
