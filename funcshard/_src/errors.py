"""The user-facing error types of funcshard: one base, one class per kind of mistake."""

from __future__ import annotations

__all__ = ["ConfigError", "FuncshardError", "MeshError", "ShardingError"]


class FuncshardError(ValueError):
    """The base of every error funcshard raises for a user's input; each message says what was expected, what
    was found, and where (pytree path, axis, shape), and how to fix it.

    Example:
        >>> import funcshard as fs
        >>> issubclass(fs.ShardingError, fs.FuncshardError) and issubclass(fs.FuncshardError, ValueError)
        True
    """


class MeshError(FuncshardError):
    """A mesh that cannot be built or does not fit the processes it runs on.

    Example:
        >>> import funcshard as fs
        >>> fs.make_mesh({"dp": 0}, backend="sim")
        Traceback (most recent call last):
        ...
        funcshard._src.errors.MeshError: make_mesh: axis 'dp' has size 0; ...
    """


class ShardingError(FuncshardError):
    """A spec, a collective or a shard_map used in a way that does not fit the mesh or the value.

    Example:
        >>> import funcshard as fs
        >>> fs.psum(1.0, "tp")
        Traceback (most recent call last):
        ...
        funcshard._src.errors.ShardingError: psum: called outside shard_map; ...
    """


class ConfigError(FuncshardError):
    """A model, command-line or configuration value that cannot work (a head count the tensor-parallel size
    does not divide, a negative learning rate, ...).

    Example:
        >>> import funcshard as fs
        >>> raise fs.ConfigError("Config: n_heads=6 is not divisible by tp=4; use a tp size that divides it.")
        Traceback (most recent call last):
        ...
        funcshard._src.errors.ConfigError: Config: n_heads=6 is not divisible by tp=4; use a tp size that divides it.
    """
