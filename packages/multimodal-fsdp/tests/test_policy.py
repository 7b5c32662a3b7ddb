"""Unit tests for multimodal_fsdp.policy: the policy names and the small module questions."""

from __future__ import annotations

import enum
from typing import get_args

import pytest
import torch
from torch import nn

from multimodal_fsdp.policy import (
    VALID_FROZEN_MULTIMODAL_SHARDING,
    FrozenMultimodalSharding,
    FrozenPolicies,
    ignored_params_for_root,
    module_is_fully_frozen,
    module_parameters,
    normalize_frozen_multimodal_sharding,
)

CHOICES = "root, per_layer, replicate"


class Tied(nn.Module):
    """Two linears sharing one weight: the parameter is registered twice."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3, bias=False)
        self.b = nn.Linear(3, 3, bias=False)
        self.b.weight = self.a.weight


def two_linears() -> nn.Sequential:
    return nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1))


# --- VALID_FROZEN_MULTIMODAL_SHARDING ----------------------------------------------------


def test_valid_choices_in_contract_order() -> None:
    assert VALID_FROZEN_MULTIMODAL_SHARDING == ("root", "per_layer", "replicate")


def test_valid_choices_match_the_literal_type() -> None:
    assert get_args(FrozenMultimodalSharding) == VALID_FROZEN_MULTIMODAL_SHARDING
    assert isinstance(VALID_FROZEN_MULTIMODAL_SHARDING, tuple)


# --- normalize_frozen_multimodal_sharding ------------------------------------------------


@pytest.mark.parametrize("choice", VALID_FROZEN_MULTIMODAL_SHARDING)
def test_normalize_accepts_every_canonical_name(choice: str) -> None:
    assert normalize_frozen_multimodal_sharding(choice) == choice


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("ROOT", "root"),
        ("Root", "root"),
        ("per_layer", "per_layer"),
        ("per-layer", "per_layer"),
        ("Per-Layer", "per_layer"),
        ("PER_LAYER", "per_layer"),
        ("pEr-LaYeR", "per_layer"),
        (" replicate ", "replicate"),
        ("\tREPLICATE\n", "replicate"),
        ("  per-layer  ", "per_layer"),
    ],
)
def test_normalize_ignores_case_dashes_and_whitespace(value: str, expected: str) -> None:
    result = normalize_frozen_multimodal_sharding(value)
    assert result == expected
    assert type(result) is str


def test_normalize_accepts_a_str_enum_and_returns_a_plain_str() -> None:
    class Policy(enum.StrEnum):
        PER_LAYER = "Per-Layer"

    result = normalize_frozen_multimodal_sharding(Policy.PER_LAYER)
    assert result == "per_layer"
    assert type(result) is str


@pytest.mark.parametrize(
    "value",
    ["bogus", "", "   ", "per layer", "perlayer", "per__layer", "roots", "replicated", "fsdp"],
)
def test_normalize_rejects_unknown_names_naming_value_and_choices(value: str) -> None:
    with pytest.raises(ValueError, match="unknown frozen multimodal sharding") as info:
        normalize_frozen_multimodal_sharding(value)
    message = str(info.value)
    assert repr(value) in message
    assert f"valid choices: {CHOICES}" in message
    for choice in VALID_FROZEN_MULTIMODAL_SHARDING:
        assert choice in message


@pytest.mark.parametrize(
    ("value", "type_name"),
    [(None, "NoneType"), (1, "int"), (b"root", "bytes"), (["root"], "list"), (1.5, "float")],
)
def test_normalize_rejects_non_strings_with_value_error(value: object, type_name: str) -> None:
    """Downstream code catches ValueError for every bad value, as with the reference."""
    with pytest.raises(ValueError, match=f"must be a str, got {type_name}") as info:
        normalize_frozen_multimodal_sharding(value)  # type: ignore[arg-type]
    assert f"valid choices: {CHOICES}" in str(info.value)
    # Also a TypeError, for callers that catch the wrong-type case by type.
    assert isinstance(info.value, TypeError)


def test_normalize_of_an_int_is_a_value_error_naming_the_choices() -> None:
    """The exact call from the issue: 3 is neither a str nor a policy."""
    with pytest.raises(ValueError, match="valid choices") as info:
        normalize_frozen_multimodal_sharding(3)  # type: ignore[arg-type]
    for choice in VALID_FROZEN_MULTIMODAL_SHARDING:
        assert choice in str(info.value)
    assert "3" in str(info.value)


# --- module_parameters ---------------------------------------------------------------------


def test_module_parameters_is_recursive_in_registration_order() -> None:
    model = two_linears()
    params = module_parameters(model)
    assert isinstance(params, list)
    assert [id(p) for p in params] == [
        id(model[0].weight),
        id(model[0].bias),
        id(model[1].weight),
        id(model[1].bias),
    ]


def test_module_parameters_lists_shared_parameters_once() -> None:
    model = Tied()
    params = module_parameters(model)
    assert len(params) == 1
    assert params[0] is model.a.weight


def test_module_parameters_of_parameterless_module_is_empty() -> None:
    assert module_parameters(nn.ReLU()) == []
    holder = nn.Module()
    holder.register_buffer("running", torch.zeros(3))
    assert module_parameters(holder) == []


# --- module_is_fully_frozen ----------------------------------------------------------------


def test_module_without_parameters_is_not_frozen() -> None:
    assert module_is_fully_frozen(nn.ReLU()) is False
    assert module_is_fully_frozen(nn.Sequential(nn.GELU(), nn.Identity())) is False


def test_module_with_only_buffers_is_not_frozen() -> None:
    holder = nn.Module()
    holder.register_buffer("running", torch.zeros(3))
    assert module_is_fully_frozen(holder) is False


def test_trainable_module_is_not_frozen() -> None:
    assert module_is_fully_frozen(two_linears()) is False


def test_partly_frozen_module_is_not_frozen() -> None:
    model = two_linears()
    model[0].requires_grad_(False)
    assert module_is_fully_frozen(model) is False
    assert module_is_fully_frozen(model[0]) is True
    assert module_is_fully_frozen(model[1]) is False


def test_one_trainable_bias_is_enough_to_not_be_frozen() -> None:
    model = two_linears()
    model.requires_grad_(False)
    model[1].bias.requires_grad_(True)
    assert module_is_fully_frozen(model) is False


def test_all_frozen_module_is_frozen() -> None:
    model = two_linears()
    model.requires_grad_(False)
    assert module_is_fully_frozen(model) is True


def test_shared_parameter_frozen_through_one_owner_freezes_both() -> None:
    model = Tied()
    assert module_is_fully_frozen(model) is False
    model.a.requires_grad_(False)
    assert module_is_fully_frozen(model.b) is True
    assert module_is_fully_frozen(model) is True


def test_shared_parameter_trainable_keeps_sibling_unfrozen() -> None:
    outer = nn.Module()
    outer.frozen = nn.Linear(2, 2)
    outer.frozen.requires_grad_(False)
    outer.shared_user = nn.Linear(2, 2, bias=False)
    outer.shared_user.requires_grad_(False)
    outer.trainable = nn.Linear(2, 2, bias=False)
    # The frozen module reuses the trainable weight: it is not fully frozen any more.
    outer.frozen.weight = outer.trainable.weight
    assert module_is_fully_frozen(outer.frozen) is False
    assert module_is_fully_frozen(outer.shared_user) is True


# --- ignored_params_for_root ---------------------------------------------------------------


def test_ignored_params_for_root_returns_the_owned_subset() -> None:
    model = two_linears()
    outside = nn.Linear(2, 2)
    ignored = {model[0].weight, model[1].bias, outside.weight}
    owned = ignored_params_for_root(model, ignored)
    assert owned == {model[0].weight, model[1].bias}
    assert all(any(p is q for q in model.parameters()) for p in owned)
    # A submodule root only gets what it owns.
    assert ignored_params_for_root(model[0], ignored) == {model[0].weight}


def test_ignored_params_for_root_preserves_the_parameter_objects() -> None:
    model = two_linears()
    owned = ignored_params_for_root(model, [model[0].weight])
    assert owned is not None
    (param,) = owned
    assert param is model[0].weight


def test_ignored_params_for_root_accepts_any_iterable() -> None:
    model = two_linears()
    wanted = [model[1].weight, model[1].bias]
    assert ignored_params_for_root(model, wanted) == set(wanted)
    assert ignored_params_for_root(model, tuple(wanted)) == set(wanted)
    assert ignored_params_for_root(model, iter(wanted)) == set(wanted)


def test_ignored_params_for_root_does_not_modify_its_input() -> None:
    model = two_linears()
    outside = nn.Linear(2, 2)
    ignored = {model[0].weight, outside.weight}
    ignored_params_for_root(model, ignored)
    assert ignored == {model[0].weight, outside.weight}


@pytest.mark.parametrize("empty", [None, set(), [], ()])
def test_ignored_params_for_root_is_none_without_ignored_params(empty: object) -> None:
    assert ignored_params_for_root(two_linears(), empty) is None  # type: ignore[arg-type]


def test_ignored_params_for_root_is_none_for_an_empty_iterator() -> None:
    assert ignored_params_for_root(two_linears(), iter([])) is None


def test_ignored_params_for_root_is_none_when_root_owns_none() -> None:
    model = two_linears()
    outside = nn.Linear(2, 2)
    assert ignored_params_for_root(model, {outside.weight, outside.bias}) is None
    assert ignored_params_for_root(model[1], {model[0].weight}) is None


def test_ignored_params_for_root_sees_shared_parameters() -> None:
    model = Tied()
    assert ignored_params_for_root(model.b, {model.a.weight}) == {model.a.weight}


# --- FrozenPolicies ------------------------------------------------------------------------


def test_frozen_policies_of_a_string_is_one_policy_for_every_module() -> None:
    policies = FrozenPolicies.parse(" Per-Layer ")
    assert policies == FrozenPolicies("per_layer")
    assert policies.by_path == ()
    assert policies.label == "per_layer"
    assert policies.policy_of("vision_tower") == "per_layer"
    assert policies.option() == "per_layer"
    assert FrozenPolicies() == FrozenPolicies.parse("root")


def test_frozen_policies_of_a_mapping_keep_the_order_and_the_rest() -> None:
    policies = FrozenPolicies.parse({"vision": "Per-Layer", "*": "replicate", "audio": "root"})
    assert policies.default == "replicate"
    assert policies.by_path == (("vision", "per_layer"), ("audio", "root"))
    assert policies.label == "vision=per_layer, audio=root, *=replicate"
    assert policies.policy_of("vision") == "per_layer"
    assert policies.policy_of("aligner") == "replicate"
    # option() is what the user would give: it parses back to the same policies.
    assert FrozenPolicies.parse(policies.option()) == policies
    assert hash(policies) == hash(FrozenPolicies.parse(policies.option()))


def test_frozen_policies_without_a_rest_default_to_root() -> None:
    policies = FrozenPolicies.parse({"vision": "replicate"})
    assert policies.default == "root"
    assert policies.label == "vision=replicate, *=root"
    # Entries equal to the default read as the one policy.
    assert FrozenPolicies.parse({"vision": "root"}).label == "root"
    assert FrozenPolicies.parse({"*": "replicate"}) == FrozenPolicies("replicate")


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (
            "shard",
            ValueError,
            rf"unknown frozen multimodal sharding 'shard'; valid choices: {CHOICES}",
        ),
        ({"vision": "sideways"}, ValueError, r"'vision': unknown frozen multimodal sharding"),
        ({"*": 3}, TypeError, r"'\*': frozen multimodal sharding must be a str, got int"),
        ({1: "root"}, TypeError, r"keys must be module paths \(str\) or '\*', got int \(1\)"),
        ({}, ValueError, rf"mapping is empty; give a policy \({CHOICES}\)"),
    ],
)
def test_frozen_policies_refuse_bad_values_naming_them_and_the_choices(
    value: object, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        FrozenPolicies.parse(value)  # type: ignore[arg-type]


def test_frozen_policies_resolve_each_discovered_path() -> None:
    policies = FrozenPolicies.parse({"vision": "per_layer", "*": "replicate"})
    resolved = policies.resolve(["vision", "aligner"], owner="Model")
    assert resolved == {"vision": "per_layer", "aligner": "replicate"}
    assert FrozenPolicies("root").resolve([], owner="Model") == {}


def test_frozen_policies_refuse_a_path_that_is_not_discovered() -> None:
    policies = FrozenPolicies.parse({"vision.blocks": "per_layer", "lm_head": "root"})
    with pytest.raises(
        ValueError,
        match=r"frozen_multimodal_sharding names 'vision.blocks', 'lm_head', not a discovered "
        r"multimodal module of Model; discovered: 'vision', 'aligner' \(use '\*' for the rest\)",
    ):
        policies.resolve(["vision", "aligner"], owner="Model")
    with pytest.raises(ValueError, match=r"names 'vision', not a .* discovered: none"):
        FrozenPolicies.parse({"vision": "root"}).resolve([], owner="Model")


@pytest.mark.parametrize(
    ("value", "where"),
    [
        ("per_layer", "frozen_multimodal_sharding='per_layer'"),
        ({"vision": "per_layer"}, "frozen_multimodal_sharding 'per_layer' for 'vision'"),
        (
            {"vision": "per_layer", "*": "per_layer"},
            "frozen_multimodal_sharding 'per_layer' for 'vision', '*'",
        ),
        ("replicate", ""),
        ({"vision": "root", "*": "replicate"}, ""),
    ],
)
def test_frozen_policies_say_where_per_layer_is_set(value: object, where: str) -> None:
    assert FrozenPolicies.parse(value).per_layer_where == where  # type: ignore[arg-type]


# ---------------------------------------------------------------- one object per policy
_POLICY_NAMES = {"root", "per_layer", "replicate"}
#: The modules that act on a policy; they must ask its object, never compare its name.
_POLICY_READERS = ("parallelizer.py", "parts.py", "estimate/choose.py", "estimate/costs.py")


def test_every_policy_name_has_one_object_that_answers_for_it() -> None:
    from multimodal_fsdp.policy import (
        FROZEN_POLICIES,
        VALID_FROZEN_MULTIMODAL_SHARDING,
        frozen_policy,
    )

    assert tuple(FROZEN_POLICIES) == VALID_FROZEN_MULTIMODAL_SHARDING
    for name, policy in FROZEN_POLICIES.items():
        assert policy.name == name
        assert frozen_policy(name) is policy
        assert policy.partly_trainable_rule
    assert frozen_policy("replicate").replicated_paths(["a", "b"]) == ["a", "b"]
    assert frozen_policy("root").replicated_paths(["a"]) == []
    assert [n for n, p in FROZEN_POLICIES.items() if p.layer_units] == ["per_layer"]
    assert [n for n, p in FROZEN_POLICIES.items() if not p.uneven_media_safe] == ["per_layer"]
    with pytest.raises(ValueError, match=r"unknown frozen multimodal sharding 'fsdp'.*root"):
        frozen_policy("fsdp")


def test_no_module_compares_a_policy_by_name() -> None:
    """Adding a policy touches policy.py (and docs/tests) only: the modules that act on
    a policy ask its object (``frozen_policy(name).layer_units`` ...), so no comparison
    with a policy's name is left in them."""
    import ast
    from pathlib import Path

    import multimodal_fsdp

    src = Path(multimodal_fsdp.__file__).parent
    found = []
    for relative in _POLICY_READERS:
        tree = ast.parse((src / relative).read_text())
        for node in ast.walk(tree):
            if not isinstance(node, ast.Compare):
                continue
            for operand in [node.left, *node.comparators]:
                if isinstance(operand, ast.Constant) and operand.value in _POLICY_NAMES:
                    found.append(f"{relative}:{node.lineno} {operand.value!r}")
        for node in ast.walk(tree):  # a dict keyed by policy names is a second table
            if (
                isinstance(node, ast.Dict)
                and {k.value for k in node.keys if isinstance(k, ast.Constant)} & _POLICY_NAMES
                == _POLICY_NAMES
            ):
                found.append(f"{relative}:{node.lineno} a table keyed by policy names")
    assert found == [], found
