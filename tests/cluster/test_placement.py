"""The placement plan on made-up clusters (a pure function: no Ray here)."""

import pytest

from strop.cluster.placement import Node, PlacementError, colocated_bundle, plan_placement


def nodes(**cpus):
    return [Node(name, f"10.0.0.{i}", {"CPU": float(c)}) for i, (name, c) in enumerate(cpus.items())]


def test_trainer_ranks_pack_onto_the_fewest_nodes_in_rank_order():
    plan = plan_placement(nodes(a=2, b=4, c=1), 4, {"CPU": 1})
    assert [(b.node, b.rank) for b in plan.bundles] == [("b", 0), ("b", 1), ("b", 2), ("b", 3)]
    assert [plan.local_rank(r) for r in range(4)] == [0, 1, 2, 3]
    plan = plan_placement(nodes(a=2, b=4, c=1), 6, {"CPU": 1})  # 4 + 2: two nodes, not three
    assert [b.node for b in plan.bundles] == ["b"] * 4 + ["a"] * 2
    assert plan.local_rank(4) == 0 and plan.local_rank(5) == 1 and plan.node_of_rank(0) == "b"


def test_disaggregated_engines_go_to_nodes_without_trainer_ranks_first():
    cluster = [Node("head", "127.0.0.1", {"CPU": 2, "node_a": 1}), Node("worker", "127.0.0.1", {"CPU": 2, "node_b": 1})]
    plan = plan_placement(cluster, 2, {"CPU": 1}, engines=2, engine={"CPU": 1})
    assert [(b.node, b.rank, b.engine) for b in plan.bundles] == [
        ("head", 0, None),
        ("head", 1, None),
        ("worker", None, 0),
        ("worker", None, 1),
    ]
    # no room elsewhere: an engine shares a trainer node rather than failing
    plan = plan_placement(nodes(a=4), 2, {"CPU": 1}, engines=2, engine={"CPU": 1})
    assert [b.node for b in plan.bundles] == ["a"] * 4


def test_colocated_engine_i_shares_rank_i_bundle_with_gpu_fractions_rounded_to_a_device():
    gpus = [Node("n0", "10.0.0.1", {"CPU": 16, "GPU": 8})]
    plan = plan_placement(
        gpus, 8, {"CPU": 1, "GPU": 0.4}, engines=8, engine={"CPU": 1, "GPU": 0.2}, placement="colocated"
    )
    assert len(plan.bundles) == 8
    assert all(b.rank == b.engine == i and b.resources == {"CPU": 2.0, "GPU": 1.0} for i, b in enumerate(plan.bundles))
    assert colocated_bundle({"GPU": 0.4}, {"GPU": 0.2}) == {"GPU": 1.0}  # 0.6 would let two ranks share a GPU
    with pytest.raises(PlacementError, match="colocated: 3 engines need as many trainer ranks"):
        plan_placement(gpus, 2, {"GPU": 0.4}, engines=3, engine={"GPU": 0.2}, placement="colocated")


def test_custom_resources_pin_roles_to_nodes():
    cluster = [Node("a", "h", {"CPU": 8, "node_a": 1}), Node("b", "h", {"CPU": 8, "node_b": 1})]
    plan = plan_placement(cluster, 2, {"CPU": 1, "node_b": 0.01}, engines=1, engine={"CPU": 1, "node_b": 0.01})
    assert {b.node for b in plan.bundles} == {"b"}


def test_a_plan_that_cannot_fit_names_the_missing_resource():
    with pytest.raises(PlacementError, match=r"missing resource 'GPU'.*no node has GPU"):
        plan_placement(nodes(a=8), 1, {"CPU": 1, "GPU": 1})
    with pytest.raises(
        PlacementError,
        match=r"missing resource 'CPU': 3 x trainer rank need CPU 2 each; the nodes "
        r"hold room for 2",
    ):
        plan_placement(nodes(a=2, b=3), 3, {"CPU": 2})
    with pytest.raises(PlacementError, match=r"missing resource 'CPU': 2 x engine .*after placing 2 trainer ranks"):
        plan_placement(nodes(a=3), 2, {"CPU": 1}, engines=2, engine={"CPU": 1})
    split = [Node("a", "h", {"CPU": 4}), Node("b", "h", {"GPU": 4})]  # enough of each, never on one node
    with pytest.raises(PlacementError, match="no single node holds one of each"):
        plan_placement(split, 1, {"CPU": 1, "GPU": 1})


def test_the_table_names_each_node_its_ranks_engines_and_resources():
    cluster = [Node("head0123456789", "10.0.0.1", {"CPU": 4}), Node("worker", "10.0.0.2", {"CPU": 4})]
    table = plan_placement(cluster, 3, {"CPU": 1}, engines=2, engine={"CPU": 2}).table().splitlines()
    assert table[0].split() == ["node", "address", "trainer", "ranks", "engines", "resources"]
    assert table[1].split() == ["head01234567", "10.0.0.1", "0-2", "-", "CPU", "3"]
    assert table[2].split() == ["worker", "10.0.0.2", "-", "0-1", "CPU", "4"]


def test_an_actor_that_lands_off_the_plan_stops_the_launch_naming_it():
    from strop.cluster.ray_cluster import ClusterError, _check_plan

    plan = plan_placement(nodes(a=2, b=2), 2, {"CPU": 1}, engines=1, engine={"CPU": 1})
    ranks = [{"node": plan.node_of_rank(r)} for r in range(2)]
    engine_node = plan.bundles[plan.engine_bundle(0)].node
    _check_plan(plan, ranks, [{"node": engine_node}])  # where the plan put them: nothing to say
    with pytest.raises(ClusterError, match=f"rank 1 runs on node {engine_node}, the plan put it on {ranks[1]['node']}"):
        _check_plan(plan, [ranks[0], {"node": engine_node}], [{"node": engine_node}])
    with pytest.raises(ClusterError, match=f"engine 0 runs on node {ranks[0]['node']}"):
        _check_plan(plan, ranks, [{"node": ranks[0]["node"]}])


@pytest.mark.parametrize("mode,slots", [("sync", 2), ("one_step_off", 3), ("async", 5)])
def test_a_lora_run_launches_vllm_with_runtime_adapters_and_a_slot_for_every_version_in_flight(tmp_path, mode, slots):
    from strop.cluster.ray_cluster import engine_args
    from strop.config import build_config

    def config(**engine):
        return build_config(
            overrides={
                "model": {"lora_rank": 12},
                "engine": {"kind": "vllm", "launch": 1, **engine},
                "cluster": {"launcher": "ray"},
                "rollout": {"mode": mode, "max_staleness": 3},
                "algo": {"off_policy_correction": "icepop"},
            }
        )

    args, env = engine_args(config(launch_args=["--seed=1"]), str(tmp_path))
    # rank 12 rounds up to vLLM's 16; every adapter a rollout may still use has a slot, in a batch and cached
    assert args[:8] == [
        "--enable-lora",
        "--max-lora-rank",
        "16",
        "--max-loras",
        str(slots),
        "--max-cpu-loras",
        str(slots),
        "--seed=1",
    ]
    assert env == {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    # the merged weights by another transport: no adapter settings
    args, env = engine_args(config(sync="disk"), str(tmp_path))
    assert "--enable-lora" not in args and env == {}
    # SGLang (0.5.23's flags): the rank, the targets, the adapters loaded and those in a batch (and the base)
    args, env = engine_args(config(kind="sglang"), str(tmp_path))
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    batch = ["--max-loaded-loras", str(slots), "--max-loras-per-batch", str(slots + 1)]
    assert args == ["--enable-lora", "--max-lora-rank", "12", "--lora-target-modules", *targets, *batch]
    assert env == {}
