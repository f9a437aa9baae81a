"""Fully async training: the window rules on hand-built sequences, a property test of the rollout producer
under random generation lengths and weight updates (lag bound, capacity, no group lost or trained twice), exact
per-token versions across a weight update through AgentFlow, and the cores async trainer and engine run on.
Async with no staleness equal to sync, end to end: tests/test_loongsage.py."""
import asyncio
import json
import random
import time

import pytest

import agentflow
import config
import cpu
import cpu_engine
import fleet
import loongsage
import rollout


def cfg_with(**kw):
    base = dict(mode="async", prompts_per_step=4, samples_per_prompt=2, global_batch_size=8, micro_batch_size=8)
    base.update(kw)
    return config.load_config(None, [f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in base.items()])


# --- the window rules, by hand -----------------------------------------------------------------------------

def test_capacity_is_b_times_one_plus_stale_steps():
    assert config.capacity(cfg_with(stale_steps=1)) == 8
    assert config.capacity(cfg_with(stale_steps=0.5)) == 6  # fractional staleness: half a step ahead
    assert config.capacity(cfg_with(mode="sync")) == 4      # sync is the pipeline with nothing ahead
    with pytest.raises(ValueError, match="stale_steps=2 applies to mode=async only"):
        config.load_config(None, ["stale_steps=2"])


def test_dispatch_rules():
    d = loongsage.groups_to_dispatch
    # C=8: 3 running + 2 buffered leave room for 3, in every window
    assert [d(w, 8, 3, 2, 10, 7) for w in config.WINDOWS] == [3, 3, 3]
    # window-gated: the oldest uncollected group is seq 3, so seqs may go up to 3+8-1 = 10; next is 9 -> 2 more
    assert d("window-gated", 8, 1, 0, 9, 3) == 2 and d("no-window", 8, 1, 0, 9, 3) == 7
    assert d("windowed-fifo", 8, 1, 0, 9, 3) == 7
    assert d("no-window", 8, 6, 4, 20, 20) == 0  # over capacity (R + Q > C) never goes negative


def test_collect_rules():
    c = loongsage.collectable
    finished = [9, 2, 5, 7]
    # no-window: any finished group, oldest first
    assert c("no-window", finished, 3, 2, 4, 8) == [2, 5, 7, 9]
    # windowed-fifo: only seqs within B=4 of the oldest unfinished (3): 2, 5 (5-3<4); 7 and 9 wait
    assert c("windowed-fifo", finished, 3, 2, 4, 8) == [2, 5]
    assert c("windowed-fifo", finished, None, 2, 4, 8) == [2, 5, 7, 9]  # nothing unfinished: all
    # window-gated: inside [oldest uncollected 2, 2 + C=5): 2 and 5; 7 and 9 wait
    assert c("window-gated", finished, 3, 2, 4, 5) == [2, 5]


def test_lag_mask_and_count():
    group = [{"weight_versions": [-1, 3, 4, 5, 5], "loss_mask": [0, 1, 1, 1, 1], "rollout_logprobs": [0, -1., -2., -3., -4.]}]
    assert loongsage.lag_over(group, 6, -1) == 0  # no bound
    assert loongsage.lag_over(group, 6, 1) == 2   # versions 3 and 4 are more than 1 behind 6
    loongsage.mask_lagging(group, 6, 1)
    assert group[0]["loss_mask"] == [0, 0, 0, 1, 1] and group[0]["rollout_logprobs"] == [0, 0.0, 0.0, -3., -4.]


def test_async_refills_the_window_before_training_up_to_c_minus_b_and_sync_does_not():
    """After a batch is taken, async dispatches at once what the window has room for, keeping a batch's room
    (R + Q <= C - B: these groups start on the old weights); sync dispatches nothing until the next rollout phase
    (its groups need the new weights)."""
    samples = [{"messages": [], "answer": str(i)} for i in range(100)]
    done = [{"weight_versions": [0], "loss_mask": [1], "rollout_logprobs": [-1.0], "reward": 1.0}] * 2
    for mode, refilled in (("async", [8, 9]), ("sync", [])):
        prod = loongsage.Producer(cfg_with(mode=mode, stale_steps=1) if mode == "async" else cfg_with(mode=mode),
                                  samples)
        seqs = [seq for seq, _ in prod.dispatch()]  # C = 8 (async) or 4 (sync)
        prod.receive([{"seq": s, "aborted": False, "trajs": done} for s in seqs[:4]], version=0)
        assert prod.full()
        prod.pop_batch()
        if mode == "async":
            assert prod.refill() == []  # 4 groups still running: exactly C - B, the next step's batch
            prod.receive([{"seq": s, "aborted": True, "trajs": []} for s in seqs[4:6]], version=0)  # engine cut
        assert [seq for seq, _ in prod.refill()] == refilled  # the two cut prompts go again, first


# --- the producer under random timing: the invariants ------------------------------------------------------

def simulate(cfg, rng, steps=12, max_len=40):
    """Drive loongsage.Producer as train() does, against a simulated engine: each group's trajectories take a
    random number of ticks (one token per tick); the weight version goes up by one after each trained batch,
    and every token records the version current when it was sampled. Returns what the invariants need."""
    prod = loongsage.Producer(cfg, [{"messages": [], "answer": str(i), "id": i} for i in range(1000)])
    running = {}  # seq -> {"left": ticks, "versions": [...]} per trajectory
    version, trained, max_rq, events = 0, [], 0, []
    for step in range(steps):
        while not prod.full():
            for seq, sample in prod.dispatch():
                n = rng.choice([1, 2, 3, max_len]) if rng.random() < 0.3 else rng.randint(1, 6)
                running[seq] = [{"left": rng.randint(1, n), "versions": []} for _ in range(cfg.samples_per_prompt)]
            max_rq = max(max_rq, len(prod.running) + len(prod.buffer) + len(prod.batch))
            done = []
            while not done:  # tick until some group finishes
                for seq, trajs in list(running.items()):
                    for t in trajs:
                        if t["left"] > 0:
                            t["versions"].append(version)
                            t["left"] -= 1
                    if all(t["left"] == 0 for t in trajs):
                        done.append({"seq": seq, "aborted": False, "trajs": [
                            {"weight_versions": t["versions"], "loss_mask": [1] * len(t["versions"]),
                             "rollout_logprobs": [-1.0] * len(t["versions"]), "reward": float(rng.random() < 0.5),
                             "group_id": seq} for t in trajs]})
                        del running[seq]
            prod.receive(done, version)
        trajs, metrics = prod.pop_batch()
        for seq, sample in prod.refill():  # as train() does: async tops the window up before training
            n = rng.choice([1, 2, 3, max_len]) if rng.random() < 0.3 else rng.randint(1, 6)
            running[seq] = [{"left": rng.randint(1, n), "versions": []} for _ in range(cfg.samples_per_prompt)]
        max_rq = max(max_rq, len(prod.running) + len(prod.buffer) + len(prod.batch))
        for _ in range(rng.randint(0, 5)):  # the engine generates on the old weights while the step trains
            for t in (t for trajs_ in running.values() for t in trajs_ if t["left"] > 0):
                t["versions"].append(version)
                t["left"] -= 1
        events.append(metrics)
        trained += [(t["group_id"], version, t) for t in trajs]
        version += 1  # train step + sync: in-flight tokens from here on carry the new version
    return prod, trained, max_rq, events, running


@pytest.mark.parametrize("seed", range(6))
def test_producer_invariants_under_random_lengths(seed):
    rng = random.Random(seed)
    window = config.WINDOWS[seed % 3]
    L = [0, 1, 2][seed % 3]
    cfg = cfg_with(stale_steps=[0.5, 1, 2][seed % 3], window=window, max_version_lag=L,
                   lag_policy=["mask", "regenerate"][seed % 2], dynamic_sampling=bool(seed % 2))
    prod, trained, max_rq, events, running = simulate(cfg, rng)
    C = config.capacity(cfg)
    assert max_rq <= C  # capacity never exceeded
    # the lag bound holds on every token that reaches the loss
    for _, version, t in trained:
        assert all(version - v <= L for v, m in zip(t["weight_versions"], t["loss_mask"]) if m)
    # every group is trained at most once, with all its samples; none is lost: each dispatched seq is trained,
    # dropped by dynamic sampling, regenerated (its prompt dispatched again), or still somewhere in the producer
    groups = {}
    for g, _, _ in trained:
        groups[g] = groups.get(g, 0) + 1
    assert set(groups.values()) <= {cfg.samples_per_prompt}
    dropped = sum(e.get("rollout/groups_sampled", 0) - e.get("rollout/groups_kept", 0) for e in events)
    regenerated = sum(e["rollout/regenerated_groups"] for e in events)
    stale = sum(e["rollout/lag_dropped_groups"] for e in events)  # every token past the bound: replaced
    pending = set(prod.running) | set(prod.finished) | set(prod.buffer) | {t[0]["group_id"] for t in prod.batch}
    assert len(groups) + dropped + regenerated + stale + len(pending) == prod.next_seq
    # a step trains B groups, however many the bound emptied (dynamic sampling may give up with fewer)
    if not cfg.dynamic_sampling:
        per_step = {}
        for g, version, _ in trained:
            per_step.setdefault(version, set()).add(g)
        assert {len(gs) for gs in per_step.values()} == {cfg.prompts_per_step}
    assert len(prod.redo) == 0 or regenerated > 0
    # something was actually off-policy, so the bound was exercised (lags > 0 trained or masked)
    masked = sum(e["rollout/lag_masked_tokens"] for e in events)
    lagged = any(version - v > 0 for _, version, t in trained for v in t["weight_versions"])
    assert lagged or masked or regenerated


def test_sync_producer_has_no_lag():
    cfg = cfg_with(mode="sync")
    prod, trained, max_rq, events, running = simulate(cfg, random.Random(0))
    assert max_rq <= cfg.prompts_per_step and not running
    assert all(v == version for _, version, t in trained for v in t["weight_versions"])


# --- exact per-token versions through AgentFlow across a weight update ---------------------------------------

def test_agentflow_records_exact_versions_across_an_update(tiny_model_dir):
    """A trajectory generating while the engine's weights change keeps, token for token, the version of the
    weights that sampled it (SGLang's weight_versions spans, read by AgentFlow), and streams back as a group."""
    url, handle = cpu_engine.serve(tiny_model_dir, max_batch=8, max_len=600, seed=1)
    try:
        cfg = cfg_with(max_context_len=600)

        async def body():
            flow = agentflow.AgentFlow(cfg, [url], tiny_model_dir)
            sampling = dict(temperature=1.0, max_new_tokens=400, ignore_eos=True)
            await flow.submit([(7, {"messages": [{"role": "user", "content": "1+2"}], "answer": "3"})], 6, sampling, 0)
            while handle.engine.state()["generated_tokens"] < 20:
                await asyncio.sleep(0.01)
            state = {n: t.clone() for n, t in handle.engine.runner.model.state_dict().items()}
            await asyncio.to_thread(handle.engine.load_weights, list(state.items()), 1)
            groups = await flow.completed()
            await flow.close()
            return groups
        groups = asyncio.run(body())
    finally:
        handle.shutdown()
    assert [g["seq"] for g in groups] == [7] and not groups[0]["aborted"] and len(groups[0]["trajs"]) == 6
    spanning = 0
    for t in groups[0]["trajs"]:
        v = [x for x, m in zip(t["weight_versions"], t["loss_mask"]) if m]
        k = v.count(0)
        assert v == [0] * k + [1] * (len(v) - k) and t["group_id"] == 7  # old weights first, then new
        spanning += 0 < k < len(v)
    assert spanning >= 1  # at least one trajectory was generating across the update (the case under test)


def test_a_short_group_streams_back_while_a_long_one_generates(tiny_model_dir):
    """Groups started in the same loop tick reach completed() one by one as each finishes: a batched /generate
    answers only when its last request ends, so if AgentFlow sent the whole tick as one batch (as it once did),
    the 1-token group would wait for the 300-token one and async would degrade to batch-at-a-time."""
    url, handle = cpu_engine.serve(tiny_model_dir, max_batch=8, max_len=600, seed=1)
    try:
        cfg = cfg_with(max_context_len=600)
        prompt = {"messages": [{"role": "user", "content": "1+2"}], "answer": "3"}

        async def body():
            flow = agentflow.AgentFlow(cfg, [url], tiny_model_dir)
            await flow.submit([(0, prompt)], 2, dict(temperature=1.0, max_new_tokens=1), 0)  # same tick:
            await flow.submit([(1, prompt)], 2, dict(temperature=1.0, max_new_tokens=300, ignore_eos=True), 0)
            first = await flow.completed()
            still_running, tokens_then = flow._producing, handle.engine.state()["generated_tokens"]
            second = await flow.completed()
            tokens_end = handle.engine.state()["generated_tokens"]
            await flow.close()
            return first, still_running, tokens_then, second, tokens_end
        first, still_running, tokens_then, second, tokens_end = asyncio.run(body())
    finally:
        handle.shutdown()
    assert [g["seq"] for g in first] == [0] and still_running == 1
    assert [g["seq"] for g in second] == [1]
    long = [len(t["response_ids"]) for t in second[0]["trajs"]]  # up to 300 (<|im_end|> still stops a row)
    assert max(long) > 1 and tokens_then < tokens_end  # the long group was still generating at the first answer


def test_engine_busy_seconds_reads_the_engines_compute_time(tiny_model_dir):
    """perf/engine_idle_frac's input: the CPU engine's busy seconds grow with generation, and an engine that does
    not answer counts as 0 instead of failing the step."""
    url, handle = cpu_engine.serve(tiny_model_dir, max_batch=4, max_len=128, seed=0)
    try:
        before = fleet.engine_busy_seconds(fleet.engine_states([url]))
        handle.engine.generate([[1, 2, 3]] * 4, {"max_new_tokens": 32, "ignore_eos": True})
        after = fleet.engine_busy_seconds(fleet.engine_states([url]))
        assert fleet.engine_busy_seconds(fleet.engine_states([url, "http://127.0.0.1:9"])) == 0.0
    finally:
        handle.shutdown()
    assert before == 0.0 < after == handle.engine.state()["busy_s"]


def test_token_versions_from_spans():
    meta = {"weight_version": "3", "weight_versions": [{"version": "1", "start": 0, "end": 2},
                                                       {"version": "3", "start": 2, "end": 5}]}
    assert rollout.token_versions(meta, 5) == [1, 1, 3, 3, 3]
    # an engine without spans: every token gets the final version
    assert rollout.token_versions({"weight_version": "3"}, 2) == [3, 3]
    assert rollout.token_versions({"weight_version": "0", "weight_versions": [
        {"version": "0", "start": 0, "end": 0}]}, 0) == []


# --- cores: async trainer and engine on disjoint cores, torch threads = their cores ---------------------------

def test_actor_cores_are_disjoint_and_only_for_async_on_a_local_cpu(monkeypatch):
    import os
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6, 7})
    cfg = cfg_with(num_engines=2, engine_threads=2)
    cores = [cpu.actor_cores(cfg, "trainer", 0), cpu.actor_cores(cfg, "engine", 0),
             cpu.actor_cores(cfg, "engine", 1)]
    assert cores == [[0], [1, 2], [3, 4]]  # trainer_threads derives to its 1 Ray CPU; engines asked for 2 each
    assert cpu.actor_cores(cfg_with(mode="sync"), "engine", 0) == []  # sync: a phase may use every core
    assert cpu.actor_cores(cfg_with(num_engines=4, engine_threads=2), "engine", 3) == []  # 1 + 8 > 8 cores
    assert cpu.actor_cores(cfg_with(colocate=True), "trainer", 0) == []


def test_lent_cores_only_where_actors_are_pinned(monkeypatch):
    import os
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6, 7})
    assert cpu.lent_cores(cfg_with(num_engines=2, engine_threads=2), 0) == [(0, [1, 2]), (1, [3, 4])]
    # two trainer ranks: engine i lends to rank i % 2
    two = cfg_with(num_engines=2, trainer_workers=2, global_batch_size=8, micro_batch_size=4)
    assert cpu.lent_cores(two, 0) == [(0, [2])] and cpu.lent_cores(two, 1) == [(1, [3])]
    for cfg in (cfg_with(mode="sync"), cfg_with(borrow_engine_cores=False), cfg_with(colocate=True)):
        assert cpu.lent_cores(cfg, 0) == [] and cpu.engine_busy_file(cfg) == ""
    path = cpu.engine_busy_file(cfg_with(num_engines=3))
    try:
        assert open(path, "rb").read() == bytes(3)  # one byte per engine, all idle
    finally:
        os.unlink(path)


def test_engine_keeps_its_busy_flag_while_it_computes(tiny_model_dir, tmp_path):
    """The CPU engine's byte in the busy file is 1 while it has a request to compute and 0 once it is done (what a
    trainer that borrows its cores reads)."""
    flag = tmp_path / "busy"
    flag.write_bytes(bytes(2))
    engine = cpu_engine.CpuEngine(tiny_model_dir, max_batch=4, max_len=400, busy_flag=(str(flag), 1)).start()
    try:
        future = engine.submit(engine.make_request([5, 6, 7], {"max_new_tokens": 300, "ignore_eos": True}))[0]
        seen = set()
        while not future.done():
            seen.add(flag.read_bytes()[1])
            time.sleep(0.001)  # a spinning reader would take the GIL from the engine's scheduler thread
        # answered on the scheduler's next iteration, which writes the flag before it takes a message: the flag is
        # final by then
        engine.state()
    finally:
        engine.stop()
    assert 1 in seen and flag.read_bytes() == bytes(2)  # byte 0 (another engine's) never touched


@pytest.fixture(scope="module")
def borrowing_run(ray_session, tiny_model_dir, tmp_path_factory):
    """An async fleet on this CPU as a run reserves it (with the engines' busy file): engine 0 on its core and
    trainer rank 0 on its own, borrowing the engine's; both start at once (an actor's start-up is one core's work).
    The two tests below read it, each driving one side: the rank, with the busy byte written by hand, and the engine,
    which writes it. Skipped below two cores (nothing is pinned, so nothing is lent)."""
    import os
    import ray
    if len(sorted(os.sched_getaffinity(0))) < 2:
        pytest.skip("needs two cores")
    cfg = cfg_with(model_path=tiny_model_dir, output_dir=str(tmp_path_factory.mktemp("borrowing")))
    run = fleet.reserve(cfg)  # with the engines' busy file, as a run makes it
    try:
        run.model = tiny_model_dir
        busy_at_start = open(run.busy_file, "rb").read() if run.busy_file else None
        run.actors = [fleet.start_engine(cfg, run, 0)]  # held: Ray ends an actor whose last handle is gone
        [rank] = fleet.start_trainers(cfg, run)
        ray.get(rank.load_hf.remote(tiny_model_dir))
        url = ray.get(run.actors[0].url.remote())  # the engine up and idle: it writes its byte only as it computes
        yield run, rank, busy_at_start, url
    finally:
        fleet.stop(run)  # the actors, the bundles, the busy file


@pytest.mark.slow
def test_trainer_computes_on_an_idle_engines_core(borrowing_run):
    """Async on this CPU: trainer rank 0 is pinned to its core and borrows engine 0's. While the engine's byte says
    busy, every layer pass runs on the trainer's one thread; once it says idle, on two threads over both cores."""
    import os
    import ray
    import torch
    from test_trainer import make_batch
    cores = sorted(os.sched_getaffinity(0))
    run, rank, _, _ = borrowing_run

    def probe(_):  # runs inside the actor
        affinity = {tuple(sorted(os.sched_getaffinity(int(t)))) for t in os.listdir("/proc/self/task")}
        return affinity, torch.get_num_threads()
    steps = []
    try:
        for busy in (1, 0):
            with open(run.busy_file, "r+b") as f:
                f.write(bytes([busy]))
            m = ray.get(rank.train_step.remote(make_batch(n_groups=4, per_group=2), 0))
            steps.append((m["perf/trainer_borrowed_frac"], *ray.get(rank.__ray_call__.remote(probe))))
    finally:
        with open(run.busy_file, "r+b") as f:
            f.write(bytes(1))  # the engine's byte back to idle, as the engine leaves it
    (busy_frac, busy_affinity, busy_threads), (idle_frac, idle_affinity, idle_threads) = steps
    assert busy_affinity == idle_affinity == {tuple(cores[:2])}  # every thread may run on both cores
    assert busy_frac == 0.0 and busy_threads == 1
    assert idle_frac == 1.0 and idle_threads == 2


@pytest.mark.slow
def test_a_runs_engine_publishes_in_the_runs_busy_file(borrowing_run):
    """Async on this CPU, fleet.reserve makes the run's busy file and fleet.start_engine hands it to its engine (an
    argument: run state, not configuration). While the engine generates, its byte reads 1; once it is done, 0: what
    a trainer rank that borrows the engine's cores reads."""
    import concurrent.futures
    import httpx
    run, _, busy_at_start, url = borrowing_run
    assert run.busy_file and busy_at_start == bytes(1)
    seen = set()
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 300, "ignore_eos": True}}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        done = pool.submit(httpx.post, url + "/generate", json=body, timeout=300)
        while not done.done():
            seen.add(open(run.busy_file, "rb").read()[0])
            time.sleep(0.001)  # a spinning reader would take a core from the engine
        assert len(done.result().json()["output_ids"]) == 300
    deadline = time.monotonic() + 5
    while open(run.busy_file, "rb").read()[0] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert 1 in seen and open(run.busy_file, "rb").read() == bytes(1)


@pytest.mark.slow
def test_async_trainer_and_engine_are_pinned_to_their_own_cores(ray_session, tiny_model_dir, tmp_path):
    """start_trainers() and start_engine() in async mode on this CPU: every thread of the trainer rank sits on one core,
    every thread of the engine on another, and each computes with as many torch threads as it has cores."""
    import os
    import ray
    import torch
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs two cores")
    # no borrowing here: a trainer rank that borrows its engine's cores may run on them too (the test above)
    cfg = cfg_with(model_path=tiny_model_dir, output_dir=str(tmp_path), borrow_engine_cores=False)

    def probe(_):  # runs inside the actor
        threads = {tuple(sorted(os.sched_getaffinity(int(t)))) for t in os.listdir("/proc/self/task")}
        return threads, torch.get_num_threads()
    run = None
    try:
        run = fleet.reserve(cfg)
        run.model = tiny_model_dir
        run.actors = [engine := fleet.start_engine(cfg, run, 0)]
        trainers = fleet.start_trainers(cfg, run)
        trainer_threads, trainer_torch = ray.get(trainers[0].__ray_call__.remote(probe))
        engine_threads, engine_torch = ray.get(engine.__ray_call__.remote(probe))
    finally:
        if run:
            fleet.stop(run)
    assert trainer_threads == {(cores[0],)} and engine_threads == {(cores[1],)}
    assert trainer_torch == 1 == engine_torch


# --- old-policy consistency: mini-batch 0's old logprobs come from its own training forward -----------------

@pytest.mark.slow
def test_first_minibatch_old_logprobs_from_the_training_forward(ray_session, tiny_model_dir):
    """Taking mini-batch 0's old logprobs from its training forward (detached) instead of a separate no-grad
    forward changes nothing: the same loss, grad norm and updated weights, on two mini-batches (the second
    still uses the step's starting weights as its old policy, not the weights after mini-batch 0's update)."""
    import torch
    from test_trainer import Ranks, make_batch, make_cfg
    # both trainers start at once (an actor's start-up is one core's work: two overlap on two cores); each is
    # its own world of one rank computing with one torch thread, so side by side changes none of their sums
    both = [Ranks(make_cfg(kl_coef=0.0, recompute_old_logprobs=recompute), 1) for recompute in (True, False)]
    try:
        batch = make_batch(n_groups=4, per_group=2)
        runs = []
        for ranks in both:
            ranks.call("load_hf", tiny_model_dir)
            [m] = ranks.call("train_step", batch, 0)
            [w] = ranks.call("export_hf_weights")
            runs.append((m, dict(w)))
    finally:
        for ranks in both:
            ranks.close()
    (m_sep, w_sep), (m_reuse, w_reuse) = runs
    assert m_sep["train/num_minibatches"] == 2 == m_reuse["train/num_minibatches"]
    for k in ("train/loss", "train/pg_loss", "train/grad_norm", "train/clip_frac", "train/gap_k3"):
        assert m_reuse[k] == pytest.approx(m_sep[k], rel=1e-6, abs=1e-9), k
    assert m_reuse["train/grad_norm"] > 0
    for name, t in w_sep.items():
        assert torch.allclose(w_reuse[name], t, rtol=0, atol=1e-7), name

