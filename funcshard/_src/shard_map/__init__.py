"""_src.shard_map."""
