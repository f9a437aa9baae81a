"""Placement of the GPU recipes on simulated GPUs: Ray advertises GPUs this CPU machine does not have, the
placement group is reserved exactly as `fleet.reserve` reserves it, and a stand-in actor (no CUDA, no
SGLang) sits where each trainer rank and engine would, with the same Ray options. Asserted: every actor lands
on its bundle and sees the GPU ids it would drive; an engine's server sees all its GPUs, on one node;
colocated engines share the trainers' GPUs, disaggregated ones never do; nothing waits for resources. The two
recipes lay out their GPUs alike and differ in CPU counts: the second one's bundles are reserved and probed, its
stand-ins are not started again."""
import json
from pathlib import Path

import pytest
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

import config
import fleet

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ["recipes/qwen3_4b_gsm8k.yaml", "recipes/code_repair_gpu.yaml"]
# disaggregated on 8 GPUs: 4 trainer GPUs (TP=2 x DP=2) and 2 engines x 2 GPUs
DISAGG = ["colocate=false", "trainer_workers=4", "num_engines=2", "gpus_per_engine=2", "sglang.tp_size=2",
          "global_batch_size=128"]


def stand_in():
    """The stand-in actor class: it answers what `fleet.bundle_gpus`'s probe answers (node id, GPU ids Ray
    assigned), asking Ray itself. Built inside a function, so cloudpickle ships it by value and its process imports only ray:
    one that imported this module would import fleet and torch, seconds of CPU each (72 actors here; on a
    loaded machine 8 such actors starting at once missed place()'s 60-s timeout). `check` compares every answer
    with `fleet.bundle_gpus`, so a stand-in that answered otherwise would fail."""
    @ray.remote(num_cpus=0)
    class StandIn:
        def where(self):
            return ray.get_runtime_context().get_node_id(), [str(g) for g in ray.get_gpu_ids()]
    return StandIn


def gpu_shape(plan: dict) -> str:
    """A plan without its CPU counts: two plans of one shape put the same GPUs in the same bundles for the same
    actors, so the stand-ins would answer alike."""
    def strip(x):
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k not in ("CPU", "num_cpus")}
        return [strip(v) for v in x] if isinstance(x, list) else x
    return json.dumps(strip(plan), sort_keys=True)


def place(cfg, stand_ins: bool = True):
    """Reserve cfg's bundles, put a stand-in on each actor's spot; returns (plan, where, trainers' and
    engines' (node, gpu ids) as the actors see them). `stand_ins=False`: reserve and probe the bundles only."""
    plan = fleet.placement(cfg)
    pg = placement_group(plan["bundles"], strategy="PACK")
    ray.get(pg.ready(), timeout=60)
    try:
        where = fleet.bundle_gpus(pg, len(plan["bundles"]))
        if not stand_ins:
            return plan, where, None
        StandIn = stand_in()
        actors = {kind: [StandIn.options(num_cpus=o["num_cpus"], num_gpus=o["num_gpus"],
                                         scheduling_strategy=PlacementGroupSchedulingStrategy(pg, o["bundle"])).remote()
                         for o in plan[kind]] for kind in ("trainers", "engines")}
        seen = {kind: ray.get([a.where.remote() for a in acts], timeout=60) for kind, acts in actors.items()}
        for acts in actors.values():
            for a in acts:
                ray.kill(a)
        return plan, where, seen
    finally:
        remove_placement_group(pg)


def check(cfg, plan, where, seen):
    T, E, k = cfg.trainer_workers, cfg.num_engines, cfg.gpus_per_engine
    assert len(seen["trainers"]) == T and len(seen["engines"]) == E
    gpus = lambda node, ids: {(node, g) for g in ids}  # noqa: E731
    trainer_gpus = []
    for r, (node, ids) in enumerate(seen["trainers"]):
        assert (node, ids) == where[r] and len(ids) == 1  # rank r on bundle r, one GPU
        trainer_gpus.append(gpus(node, ids))
    assert len(set().union(*trainer_gpus)) == T  # one GPU per rank, none shared between ranks
    for i, (node, ids) in enumerate(seen["engines"]):
        o = plan["engines"][i]
        server = fleet.engine_gpu_ids(plan, where, i)  # what CUDA_VISIBLE_DEVICES will hold for SGLang
        assert (node, ids) == where[o["bundle"]] and len(server) == k == len(set(server))
        assert {where[b][0] for b in o["gpu_bundles"]} == {node}  # all of an engine's GPUs on its node
        mine = {(node, g) for g in server}
        if cfg.colocate:  # engine i shares the GPUs of trainer ranks i*k .. i*k+k-1
            assert mine == set().union(*trainer_gpus[i * k:(i + 1) * k])
        else:
            assert not mine & set().union(*trainer_gpus)
    if not cfg.colocate:
        engine_gpus = [{(where[b][0], g) for b in o["gpu_bundles"] for g in where[b][1]} for o in plan["engines"]]
        assert len(set().union(*engine_gpus)) == E * k  # engines never share a GPU either


@pytest.mark.parametrize("nodes", [1, 2], ids=["1x8", "2x4"])
@pytest.mark.slow
def test_gpu_recipes_place_on_simulated_gpus(nodes):
    from ray.cluster_utils import Cluster
    ray.shutdown()  # the session's Ray (tests/conftest.py): this test needs a cluster that advertises GPUs
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 96, "num_gpus": 8 // nodes})
    for _ in range(nodes - 1):
        cluster.add_node(num_cpus=96, num_gpus=8 // nodes)
    ray.init(address=cluster.address)  # the nodes' workers inherit PYTHONPATH (tests/conftest.py)
    try:
        placed, shapes = 0, set()
        for recipe in RECIPES:
            for extra in ([], DISAGG):
                cfg = config.load_config(str(ROOT / recipe), extra)
                shape = gpu_shape(fleet.placement(cfg))
                # a layout of a shape already checked differs in CPU counts only: its bundles are reserved (they
                # fit) and probed, and the stand-ins (~0.4 s of process start each) are not started again
                plan, where, seen = place(cfg, stand_ins=shape not in shapes)
                if seen is not None:
                    check(cfg, plan, where, seen)
                shapes.add(shape)
                assert len(where) == len(plan["bundles"])
                placed += 1
        assert placed == 4 and len(shapes) == 2  # both recipes: the same GPU layouts, other CPU counts
        table = fleet.placement_table(cfg, fleet.placement(cfg))
        assert table.count("trainer") == cfg.trainer_workers and "engine 1" in table
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_colocated_engines_must_fit_the_trainers_gpus():
    with pytest.raises(ValueError, match="must fit on the trainers' 8 GPUs"):
        config.load_config(str(ROOT / RECIPES[0]), ["num_engines=8"])
    with pytest.raises(ValueError, match="sglang.tp_size=2 but gpus_per_engine=4"):
        config.load_config(str(ROOT / RECIPES[0]), ["gpus_per_engine=4", "num_engines=2"])
