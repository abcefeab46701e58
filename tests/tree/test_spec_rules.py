"""``spec_rules`` (regex rules on leaf paths) and ``logical_to_mesh`` (logical axis rules)."""

from __future__ import annotations

import re
from collections import namedtuple

import pytest
import torch

import funcshard as fs
from funcshard import P, logical_to_mesh, spec_rules


def _has(*fragments: str) -> str:
    """A regex that matches when every fragment occurs in the message (literally, in any order)."""
    return "(?s)" + "".join(f"(?=.*{re.escape(f)})" for f in fragments)


def _params(n_layers: int = 2) -> dict:
    return {
        "embed": torch.zeros(16, 8),
        "layers": [
            {
                "attn": {"wq": torch.zeros(8, 8), "wo": torch.zeros(8, 8)},
                "mlp": {"w1": torch.zeros(8, 32), "w2": torch.zeros(32, 8)},
                "norm": torch.zeros(8),
            }
            for _ in range(n_layers)
        ],
        "out_norm": torch.zeros(8),
    }


LLAMA_RULES = [
    (r"embed", P("tp", None)),
    (r"layers/\d+/attn/w[qkv]", P(None, "tp")),
    (r"layers/\d+/attn/wo", P("tp", None)),
    (r"layers/\d+/mlp/w1", P(("fsdp", "dp"), "tp")),
    (r"layers/\d+/mlp/w2", P("tp", "fsdp")),
]


# -- spec_rules --------------------------------------------------------------------------------------------


def test_nested_paths_and_structure() -> None:
    specs = spec_rules(_params(), LLAMA_RULES)
    assert specs["embed"] == P("tp", None)
    for layer in specs["layers"]:
        assert layer["attn"] == {"wq": P(None, "tp"), "wo": P("tp", None)}
        assert layer["mlp"] == {"w1": P(("fsdp", "dp"), "tp"), "w2": P("tp", "fsdp")}
        assert layer["norm"] == P()
    assert specs["out_norm"] == P()
    assert isinstance(specs["layers"], list) and len(specs["layers"]) == 2


def test_first_match_wins() -> None:
    tree = {"a": {"w": torch.zeros(4, 4)}, "b": {"w": torch.zeros(4, 4)}}
    specs = spec_rules(tree, [(r"a/w", P("tp")), (r".*w", P(None, "tp")), (r"b/w", P("dp"))])
    assert specs == {"a": {"w": P("tp")}, "b": {"w": P(None, "tp")}}
    # swapping the order changes the winner
    specs = spec_rules(tree, [(r".*w", P(None, "tp")), (r"a/w", P("tp"))])
    assert specs["a"]["w"] == P(None, "tp")


def test_fullmatch_not_search() -> None:
    tree = {"layers": [{"wq": torch.zeros(2, 2)}], "wq": torch.zeros(2, 2), "wqx": torch.zeros(2, 2)}
    specs = spec_rules(tree, [(r"wq", P("tp"))])
    assert specs["wq"] == P("tp")
    assert specs["layers"][0]["wq"] == P()  # "wq" does not fullmatch "layers/0/wq"
    assert specs["wqx"] == P()  # nor "wqx"
    assert spec_rules(tree, [(r".*wq", P("tp"))])["layers"][0]["wq"] == P("tp")


def test_default_spec_and_none_nodes() -> None:
    tree = {"w": torch.zeros(4, 4), "b": None, "t": (torch.zeros(2), [torch.zeros(3)])}
    specs = spec_rules(tree, [(r"w", P("tp"))], default=P("dp"))
    assert specs == {"w": P("tp"), "b": None, "t": (P("dp"), [P("dp")])}


def test_default_none_lists_every_unmatched_leaf() -> None:
    params = _params(n_layers=3)
    rules = [(r"embed", P("tp")), (r"layers/\d+/attn/.*", P(None, "tp")), (r"w1", P("tp"))]
    with pytest.raises(fs.ShardingError) as err:
        spec_rules(params, rules, default=None)
    msg = str(err.value)
    unmatched = [f"layers/{i}/{name}" for i in range(3) for name in ("mlp/w1", "mlp/w2", "norm")] + ["out_norm"]
    for path in unmatched:
        assert f"'{path}'" in msg, path
    assert "layers/0/attn/wq" not in msg and "'embed' (" not in msg  # matched leaves are not listed
    assert f"{len(unmatched)} leaves match no rule" in msg
    assert "(8, 32)" in msg and "(8,)" in msg  # shapes
    assert "default=P()" in msg  # the hint
    assert "re.fullmatch" in msg and "'.*w1'" in msg  # 'w1' matched only part of 'layers/0/mlp/w1'


def test_callable_spec() -> None:
    def by_shape(path: str, leaf: torch.Tensor) -> P:
        return P("tp") if leaf.shape[0] % 4 == 0 else P()

    tree = {"a": torch.zeros(8, 2), "b": torch.zeros(6, 2)}
    seen = []

    def record(path: str, leaf: torch.Tensor) -> P:
        seen.append(path)
        return by_shape(path, leaf)

    assert spec_rules(tree, [(r".*", record)]) == {"a": P("tp"), "b": P()}
    assert seen == ["a", "b"]
    assert spec_rules(tree, [], default=by_shape) == {"a": P("tp"), "b": P()}
    with pytest.raises(fs.ShardingError, match=_has("at 'a'", "returned ('tp',)", "must return a P")):
        spec_rules(tree, [(r"a", lambda path, leaf: ("tp",))])


def test_leaves_with_shape() -> None:
    mesh = fs.make_mesh({"tp": 2}, backend="sim")
    arr = fs.device_put(torch.zeros(4, 4), mesh, P("tp"))
    shaped = namedtuple("Shaped", ["shape", "dtype"])
    tree = {"arr": arr, "size": torch.Size([4, 6]), "nt": shaped((6, 4), torch.float32)}
    specs = spec_rules(tree, [(r"size", P(None, "tp")), (r"nt", P("tp"))], mesh=mesh)
    assert specs == {"arr": P(), "size": P(None, "tp"), "nt": P("tp")}
    assert spec_rules(torch.zeros(4), [(r"", P("tp"))]) == P("tp")  # a bare leaf has the empty path


def test_mesh_validation_names_path() -> None:
    mesh = fs.make_mesh({"dp": 2, "tp": 2}, backend="sim")
    tree = {"layers": [{"w": torch.zeros(4, 4)}, {"w": torch.zeros(3, 4)}]}
    assert spec_rules(tree, [(r".*/w", P(None, "tp"))], mesh=mesh) == {"layers": [{"w": P(None, "tp")}] * 2}
    # a dim its axes do not divide is split unevenly (torch.tensor_split's blocks): a valid spec
    assert spec_rules(tree, [(r".*/w", P("tp"))], mesh=mesh) == {"layers": [{"w": P("tp")}] * 2}
    with pytest.raises(fs.ShardingError, match=_has("spec_rules at 'layers/0/w'", "'cp'", "does not have")):
        spec_rules(tree, [(r".*/w", P("cp"))], mesh=mesh)
    with pytest.raises(fs.ShardingError, match=_has("at 'layers/0/w'", "3 entries", "only 2 dims")):
        spec_rules(tree, [(r".*/w", P(None, None, "tp"))], mesh=mesh)
    with pytest.raises(fs.ShardingError, match=_has("at 'layers/0/w'", "'tp'", "twice")):
        spec_rules(tree, [(r".*/w", P("tp", "tp"))], mesh=mesh)
    with pytest.raises(fs.ShardingError, match=_has("at 'name'", "no shape", "P()")):
        spec_rules({"name": "llama"}, [(r".*", P("tp"))], mesh=mesh)
    assert spec_rules({"name": "llama", "n": 3}, [], mesh=mesh) == {"name": P(), "n": P()}


def test_drop_missing_axes() -> None:
    mesh = fs.make_mesh({"dp": 2, "fsdp": 2}, backend="sim")  # no "tp"
    specs = spec_rules(_params(), LLAMA_RULES, mesh=mesh, drop_missing_axes=True)
    assert specs["embed"] == P()
    assert specs["layers"][0]["attn"]["wq"] == P()
    assert specs["layers"][1]["mlp"]["w1"] == P(("fsdp", "dp"))
    assert specs["layers"][1]["mlp"]["w2"] == P(None, "fsdp")
    with pytest.raises(fs.ShardingError, match=_has("at 'embed'", "'tp'")):
        spec_rules(_params(), LLAMA_RULES, mesh=mesh)
    with pytest.raises(fs.ShardingError, match="needs a mesh"):
        spec_rules(_params(), LLAMA_RULES, drop_missing_axes=True)


def test_bad_rules() -> None:
    tree = {"w": torch.zeros(2)}
    with pytest.raises(fs.ShardingError, match=_has("pattern 'w[q'", "not a valid regular expression")):
        spec_rules(tree, [(r"w", P()), (r"w[q", P("tp"))])
    with pytest.raises(fs.ShardingError, match=_has("rule 0", "spec ('tp', None)", "P(...)")):
        spec_rules(tree, [(r"w", ("tp", None))])
    with pytest.raises(fs.ShardingError, match=_has("rule 0", "(pattern, spec) pair")):
        spec_rules(tree, [r"w"])
    with pytest.raises(fs.ShardingError, match=_has("rule 0", "type int")):
        spec_rules(tree, [(3, P())])
    with pytest.raises(fs.ShardingError, match="default"):
        spec_rules(tree, [], default="tp")
    # compiled patterns and an ordered dict of rules are accepted too
    assert spec_rules(tree, [(re.compile("w"), P("tp"))]) == {"w": P("tp")}
    assert spec_rules(tree, {r"x": P("dp"), r"w": P("tp")}) == {"w": P("tp")}


# -- logical_to_mesh ---------------------------------------------------------------------------------------

TRANSFORMER_RULES = [
    ("batch", ("dp", "fsdp")),
    ("seq", "cp"),
    ("seq", None),
    ("embed", "fsdp"),
    ("embed", None),
    ("mlp", "tp"),
    ("heads", "tp"),
    ("kv", None),
    ("vocab", "tp"),
    ("norm", None),
]

LOGICAL = {
    "tokens": P("batch", "seq"),
    "acts": P("batch", "seq", "embed"),
    "embed": P("vocab", "embed"),
    "wq": P("embed", ("heads", "kv")),
    "w1": P("embed", "mlp"),
    "w2": P("mlp", "embed"),
    "norm": P("norm"),
    "none": None,
}


def test_typical_transformer_rules() -> None:
    specs = logical_to_mesh(LOGICAL, TRANSFORMER_RULES)
    assert specs == {
        # "fsdp" is taken by batch, so embed falls back to None
        "tokens": P(("dp", "fsdp"), "cp"),
        "acts": P(("dp", "fsdp"), "cp", None),
        "embed": P("tp", "fsdp"),
        "wq": P("fsdp", "tp"),
        "w1": P("fsdp", "tp"),
        "w2": P("tp", "fsdp"),
        "norm": P(),
        "none": None,
    }


def test_single_spec_returns_spec() -> None:
    assert logical_to_mesh(P("batch", None, "embed"), TRANSFORMER_RULES) == P(("dp", "fsdp"), None, None)
    assert isinstance(logical_to_mesh(P(), TRANSFORMER_RULES), P)


def test_mesh_filtering() -> None:
    mesh = fs.make_mesh({"dp": 2, "tp": 2}, backend="sim")  # no fsdp, no cp
    specs = logical_to_mesh(LOGICAL, TRANSFORMER_RULES, mesh=mesh)
    assert specs["tokens"] == P("dp", None)  # batch keeps the axes the mesh has; seq falls back to None
    assert specs["acts"] == P("dp")
    assert specs["embed"] == P("tp")
    assert specs["w1"] == P(None, "tp")
    mesh = fs.make_mesh({"fsdp": 4}, backend="sim")
    specs = logical_to_mesh(LOGICAL, TRANSFORMER_RULES, mesh=mesh)
    assert specs["w1"] == P("fsdp")  # mlp -> tp, absent: as if of size 1, replicated
    assert specs["acts"] == P("fsdp")
    # a rule whose axes are all absent is skipped in favour of a later one the mesh has
    rules = [("batch", "fsdp"), ("batch", "dp")]
    assert logical_to_mesh(P("batch"), rules, mesh=fs.make_mesh({"dp": 2}, backend="sim")) == P("dp")
    assert logical_to_mesh(P("batch"), rules, mesh={"dp": 2, "fsdp": 2}) == P("fsdp")


def test_fallback_when_axis_taken() -> None:
    rules = [("mlp", "tp"), ("mlp", None), ("embed", "tp"), ("embed", "fsdp"), ("embed", None)]
    assert logical_to_mesh(P("embed", "mlp"), rules) == P("tp", None)  # dim order decides: embed takes tp first
    assert logical_to_mesh(P("mlp", "embed"), rules) == P("tp", "fsdp")
    mesh = fs.make_mesh({"tp": 2}, backend="sim")
    assert logical_to_mesh(P("mlp", "embed"), rules, mesh=mesh) == P("tp", None)


def test_no_rule_error() -> None:
    with pytest.raises(fs.ShardingError, match=_has("at 'layers/0/w'", "'experts'", "no rule", "P('experts', 'mlp')")):
        logical_to_mesh({"layers": [{"w": P("experts", "mlp")}]}, TRANSFORMER_RULES)
    with pytest.raises(fs.ShardingError, match=_has("logical_to_mesh", "'experts'", "('experts', None)")):
        logical_to_mesh(P("experts"), TRANSFORMER_RULES)


def test_conflict_error() -> None:
    rules = [("embed", "tp"), ("mlp", "tp")]
    with pytest.raises(fs.ShardingError) as err:
        logical_to_mesh({"layers": [{"w1": P("embed", "mlp")}]}, rules)
    msg = str(err.value)
    for fragment in ("at 'layers/0/w1'", "'mlp'", "'embed'", "'tp'", "dim 1", "dim 0", "('mlp', None)", "fallback"):
        assert fragment in msg, fragment
    # within one dim too
    with pytest.raises(fs.ShardingError, match=_has("'kv'", "'heads'", "'tp'")):
        logical_to_mesh(P(("heads", "kv")), [("heads", "tp"), ("kv", "tp")])
    # a tuple rule is blocked when any of its axes is taken
    with pytest.raises(fs.ShardingError, match=_has("'batch'", "'fsdp'", "'embed'")):
        logical_to_mesh(P("embed", "batch"), [("embed", "fsdp"), ("batch", ("dp", "fsdp"))])


def test_none_and_tuple_rules() -> None:
    rules = [("batch", ("dp", "fsdp")), ("heads", "tp"), ("kv", ("cp", "ep")), ("seq", None), ("seq", "cp")]
    assert logical_to_mesh(P("batch", "seq"), rules) == P(("dp", "fsdp"))  # first rule wins: None over cp
    assert logical_to_mesh(P(("heads", "kv"), None, "batch"), rules) == P(("tp", "cp", "ep"), None, ("dp", "fsdp"))
    assert logical_to_mesh(P("seq", None), rules) == P()
    # P entries that are already None pass through
    assert logical_to_mesh(P(None, "heads"), rules) == P(None, "tp")


def test_bad_logical_rules() -> None:
    for bad in (("mlp",), ("mlp", 3), (3, "tp"), ("mlp", ("tp", 1)), ("mlp", ("tp", "tp")), "mlp"):
        with pytest.raises(fs.ShardingError, match=_has("rule 1", "(logical_name, mesh_axes)")):
            logical_to_mesh(P("embed"), [("embed", None), bad])
    with pytest.raises(fs.ShardingError, match="sequence of"):
        logical_to_mesh(P("embed"), "embed")
    with pytest.raises(fs.ShardingError, match=_has("at 'w'", "expected a spec")):
        logical_to_mesh({"w": "embed"}, [("embed", None)])
    assert logical_to_mesh(P("embed", "mlp"), {"embed": "fsdp", "mlp": "tp"}) == P("fsdp", "tp")
