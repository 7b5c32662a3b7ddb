"""The balanced tower call on 2 spawned gloo ranks against a single-process reference:
the outputs of each rank's items, its input gradients and the parameter gradients summed
over ranks equal the reference, under skewed media distributions; the collectives are
the documented ones; an unsplittable call fails on every rank."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from fsdp_core.testing import run_on_gloo_ranks

sys.path.insert(0, str(Path(__file__).parent))
import _balance_exchange_rank_fns as rank_fns

FORWARD = ["allgather_", "alltoall_base_", "allgather_", "alltoall_base_"]


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One spawn of 2 gloo ranks runs the plain and the sharded cases."""
    out = tmp_path_factory.mktemp("balance")
    run_on_gloo_ranks(rank_fns.run_all_cases, 2, str(out), timeout_s=180)
    return out


@pytest.fixture(scope="module")
def results(launched: Path) -> list[dict[str, Any]]:
    return [json.loads((launched / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("case", sorted(rank_fns.CASES))
def test_outputs_and_gradients_match_one_process(case: str, results: list[dict[str, Any]]) -> None:
    spec = rank_fns.CASES[case]
    for rank, by_case in enumerate(results):
        outcome = by_case[case]
        if spec["counts"][rank]:
            assert outcome["output_type"] == "BaseModelOutputWithPooling"
            assert outcome["output_shapes_equal"]
            assert outcome["output_diff"] < 1e-5, (rank, outcome)
            if spec["input_grad"]:
                assert outcome["input_grad_diff"] < 1e-5, (rank, outcome)
        else:
            assert "output_diff" not in outcome
        if spec["trainable"]:
            assert outcome["param_grad_norm"] > 0
            assert outcome["param_grad_diff"] < 1e-5 * max(1.0, outcome["param_grad_norm"])


def _expected_runs(spec: dict[str, Any], rank: int) -> int:
    """Tower runs on ``rank``: its own call when nothing moves; with an exchange one run
    on its share (a placeholder when it has none and the tower owns units), or two for
    a tower without units that keeps items and receives others' (it encodes the kept
    ones while the others' arrive)."""
    from multimodal_fsdp.balance.assign import route_call

    counts = [n or 0 for n in spec["counts"]]
    empty = spec.get("run_when_empty", False)
    route = route_call([[1] * n for n in counts], run_when_empty=empty)
    if route is None:
        return 1 if spec["counts"][rank] is not None else 0
    owners = route.owners
    kept = any(owners[rank][i] == rank for i in range(counts[rank]))
    received = any(
        owners[s][i] == rank for s in range(len(counts)) if s != rank for i in range(counts[s])
    )
    if kept and received and not empty:
        return 2
    return 1 if kept or received or empty else 0


@pytest.mark.parametrize("case", sorted(rank_fns.CASES))
def test_every_rank_runs_the_tower_with_the_documented_collectives(
    case: str, results: list[dict[str, Any]]
) -> None:
    """One slot gather, then, where items move or a placeholder runs, the inputs'
    all_to_all, the status gather and the outputs' all_to_all; in backward the
    gradients' all_to_alls: the ops exchange_traffic lists, in its order."""
    spec = rank_fns.CASES[case]
    for rank, by_case in enumerate(results):
        outcome = by_case[case]
        assert outcome["tower_runs"] == _expected_runs(spec, rank), (rank, outcome["tower_runs"])
        predicted = [tuple(op) for op in outcome["predicted_ops"]]
        assert outcome["forward_ops"] == [op for op, phase in predicted if phase == "forward"]
        assert outcome["backward_ops"] == [op for op, phase in predicted if phase == "backward"]
        assert outcome["forward_ops"][0] == "allgather_"


def test_an_even_distribution_exchanges_nothing_but_the_slots(
    results: list[dict[str, Any]],
) -> None:
    """Every item stays on its rank (2 and 2, frozen tower): one slot gather, the ranks'
    own calls, no all_to_all in either direction."""
    for by_case in results:
        assert by_case["clip_frozen_even"]["forward_ops"] == ["allgather_"]
        assert by_case["clip_frozen_even"]["backward_ops"] == []
    moved = results[0]["clip_three_to_one"]["forward_ops"]
    assert moved == FORWARD


@pytest.mark.parametrize("case", sorted(rank_fns.CASES))
def test_exchange_traffic_predicts_the_bytes_exactly(
    case: str, results: list[dict[str, Any]]
) -> None:
    for by_case in results:
        outcome = by_case[case]
        assert [tuple(x) for x in outcome["measured_bytes"]] == [
            tuple(x) for x in outcome["predicted_bytes"]
        ]


def test_an_unsplittable_call_fails_on_every_rank(results: list[dict[str, Any]]) -> None:
    outcomes = [r["bad_call_on_one_rank"] for r in results]
    assert [o["type"] for o in outcomes] == ["ValueError", "ValueError"]
    assert "'pixel_attention_mask' has shape (3, 16, 16)" in outcomes[1]["message"]
    assert "rank(s) [1] could not split or run their call" in outcomes[0]["message"]
    assert [o["group_works"] for o in outcomes] == [True, True]


def test_under_the_fake_group_the_collectives_are_the_predicted_ones() -> None:
    """Plan costs are measured under the fake group, where every rank looks like the
    calling one: the same collectives and bytes as ``exchange_traffic`` predicts."""
    import torch

    from fsdp_core.fake_group import fake_process_group
    from multimodal_fsdp.balance import balanced_call, exchange_traffic, media_layout_for

    world = 4
    with fake_process_group(world, rank=1):
        tower = rank_fns._clip()
        pixels = torch.randn(3, 3, 16, 16)
        kwargs = {"return_dict": True, "output_hidden_states": True}
        counter = rank_fns._Collectives()
        with counter:
            output = balanced_call(tower, (pixels,), kwargs)
            (output.last_hidden_state.sum() + output.hidden_states[1].sum()).backward()
        layout = media_layout_for(tower)
        call = layout.split_call(tower, (pixels,), kwargs)
        _, pieces = layout.split_output(output, [1, 1, 1])
        inputs = [[t.fields[0].nbytes for t in call.items]] * world
        outputs = [[sum(t.nbytes for t in piece) for piece in pieces]] * world
        predicted = exchange_traffic(
            [[item.cost for item in call.items]] * world,
            rank=1,
            spec=call.spec,
            input_bytes=inputs,
            output_bytes=outputs,
            output_grad_bytes=outputs,
            output_tensors=len(pieces[0]),
        )
    # Every rank has the same items: each keeps its own, only the slots travel.
    assert counter.ops == ["allgather_"]
    assert counter.sizes == [(c.sent, c.received) for c in predicted]
    assert [c.kind for c in predicted] == ["all_gather"]


@pytest.fixture(scope="module")
def sharded(launched: Path) -> list[dict[str, Any]]:
    return [json.loads((launched / f"sharded{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("case", sorted(rank_fns.SHARDED_CASES))
def test_a_tower_with_fsdp_units_runs_on_every_rank_in_step(
    case: str, sharded: list[dict[str, Any]]
) -> None:
    """``run_when_empty``: a rank with nothing to encode runs the tower on a placeholder,
    so both ranks issue the same collectives (the tower's all-gathers and
    reduce-scatters included) and the gradients equal one process's."""
    outcomes = [by_case[case] for by_case in sharded]
    assert [o["tower_runs"] for o in outcomes] == [1, 1]
    assert outcomes[0]["ops"] == outcomes[1]["ops"]
    assert "_reduce_scatter_base_" in outcomes[0]["ops"]
    for outcome in outcomes:
        assert outcome["param_grad_norm"] > 0
        assert outcome["param_grad_diff"] < 1e-5 * max(1.0, outcome["param_grad_norm"])


@pytest.mark.parametrize("case", rank_fns.UNREAD_CASES)
def test_parameters_that_feed_only_unread_outputs_keep_no_gradient(
    case: str, results: list[dict[str, Any]]
) -> None:
    """The loss reads one middle hidden state (as LLaVA does): the last encoder layer and
    the post-layernorm get no gradient (``None``, not zeros) on every rank, exactly as in
    one process, so weight decay and momentum leave them alone; the rank that encodes
    nothing (a placeholder run) included."""
    for by_case in results:
        outcome = by_case[case]
        unread = outcome["reference_params_without_grad"]
        assert any("encoder.layers.1." in name for name in unread), unread
        assert any("post_layernorm" in name for name in unread), unread
        assert outcome["params_without_grad"] == unread


@pytest.mark.parametrize("case", sorted(rank_fns.SHARDED_UNREAD_CASES))
def test_a_sharded_tower_keeps_no_gradient_where_no_loss_reaches(
    case: str, sharded: list[dict[str, Any]]
) -> None:
    """FSDP units per encoder layer, the pooled output unread: the post-layernorm's
    gradient stays ``None`` on every rank (a placeholder run included), the other
    gradients equal one process's."""
    for by_case in sharded:
        outcome = by_case[case]
        unread = outcome["reference_params_without_grad"]
        assert any("post_layernorm" in name for name in unread), unread
        assert outcome["params_without_grad"] == unread
        assert outcome["param_grad_diff"] < 1e-5 * max(1.0, outcome["param_grad_norm"])
    assert sharded[0][case]["ops"] == sharded[1][case]["ops"]


@pytest.mark.parametrize(
    "case",
    [
        "vlm_text_only_rank_tower_in_root",
        "vlm_text_only_rank_tower_units",
        "vlm_call_per_image_and_barrier",
    ],
)
def test_a_text_only_rank_joins_inside_a_sharded_model(
    case: str, sharded: list[dict[str, Any]]
) -> None:
    """The exchange's backward collectives and FSDP's reduce-scatters of the decoder
    layers run in the same order on a rank with media and on a text-only rank that
    joined where the tower would run (else this hangs or the gradients differ)."""
    for by_case in sharded:
        outcome = by_case[case]
        assert outcome["params_with_grad"] > 20
        assert outcome["param_grad_diff"] < 1e-5


def test_join_remaining_calls_joins_as_many_calls_as_the_busiest_rank_made(
    sharded: list[dict[str, Any]],
) -> None:
    """Rank 0 makes one call per image (3), rank 1 none: at the barrier rank 1 joins all
    three, rank 0 none; both then end on the same round."""
    joined = [by_case["vlm_call_per_image_and_barrier"]["joined"] for by_case in sharded]
    assert joined == [0, 3]


def test_the_last_round_of_the_barrier_is_one_slot_gather() -> None:
    from multimodal_fsdp.balance import exchange_traffic
    from multimodal_fsdp.balance.traffic import SLOT_INTS

    empty: list[list[int]] = [[], []]
    rounds = exchange_traffic(empty, rank=1, spec=None, input_bytes=empty, output_bytes=empty)
    assert [(c.kind, c.sent, c.received) for c in rounds] == [
        ("all_gather", SLOT_INTS * 8, 2 * SLOT_INTS * 8)
    ]
    with pytest.raises(ValueError, match="one size per item"):
        exchange_traffic([[1], []], rank=0, spec=None, input_bytes=empty, output_bytes=empty)


def test_the_output_gradients_carry_one_flag_byte_per_output_tensor_to_every_rank() -> None:
    """So that an output no loss reads gets no gradient on any rank, the gradient
    all_to_all carries one has-gradient byte per output tensor to every rank; predicting
    it needs the number of output tensors."""
    from multimodal_fsdp.balance import CallSpec, exchange_traffic

    costs = [[1, 1, 1], []]
    sizes = [[10, 10, 10], []]
    spec = CallSpec(fields=("pixel_values",))
    rounds = exchange_traffic(
        costs,
        rank=1,
        spec=spec,
        input_bytes=sizes,
        output_bytes=sizes,
        output_grad_bytes=sizes,
        output_tensors=3,
    )
    forward_back, backward = rounds[-2], rounds[-1]
    assert backward.phase == "backward"
    assert (backward.sent, backward.received) == (
        forward_back.received + 2 * 3,
        forward_back.sent + 2 * 3,
    )
    with pytest.raises(ValueError, match="output_grad_bytes needs output_tensors="):
        exchange_traffic(
            costs,
            rank=1,
            spec=spec,
            input_bytes=sizes,
            output_bytes=sizes,
            output_grad_bytes=sizes,
        )


def test_no_rank_waits_alone_when_no_loss_reads_a_tower_output(tmp_path: Path) -> None:
    """The tower's features reach the loss detached on the calling rank; the other rank
    joined the call (its zero anchor is in its loss). Both ranks run the exchange's
    backward all_to_all (else the joining rank waits alone), and the tower keeps no
    gradient anywhere, as in one process."""
    run_on_gloo_ranks(rank_fns.run_unread_everywhere, 2, str(tmp_path), timeout_s=30)
    outcomes = [json.loads((tmp_path / f"unread{r}.json").read_text()) for r in range(2)]
    assert [(o["calls"], o["joined"]) for o in outcomes] == [(1, 0), (0, 1)]
    assert outcomes[0]["backward_ops"] == outcomes[1]["backward_ops"] == ["alltoall_base_"]
    assert [o["tower_params_with_grad"] for o in outcomes] == [[], []]
    assert all(o["decoder_grad_norm"] > 0 for o in outcomes)
