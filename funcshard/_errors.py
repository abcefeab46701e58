"""The two user-facing error types of funcshard."""

from __future__ import annotations

__all__ = ["MeshError", "ShardingError"]


class MeshError(ValueError):
    """A mesh that cannot be built or does not fit the processes it runs on.

    Example:
        >>> import funcshard as fs
        >>> fs.make_mesh({"dp": 0}, backend="sim")
        Traceback (most recent call last):
        ...
        funcshard._errors.MeshError: make_mesh: axis 'dp' has size 0; ...
    """


class ShardingError(ValueError):
    """A spec, a collective or a shard_map used in a way that does not fit the mesh or the value.

    Example:
        >>> import funcshard as fs
        >>> fs.psum(1.0, "tp")
        Traceback (most recent call last):
        ...
        funcshard._errors.ShardingError: psum: called outside shard_map; ...
    """
