"""teacher.py and the student side of on-policy distillation, against the real parts (TeacherWorker and
TrainerWorker Ray actors, Megatron-Core over gloo).

What each test proves:
* the teacher's sampled-token logprobs equal the trainer's for the same weights and tokens (<= 1e-6);
* the full-vocabulary path (teacher hidden states + the teacher's LM head applied on the student side,
  trainer.opd_terms) gives the same forward KL / reverse KL / JSD as the teacher's full logits;
* interleaved teachers swap once per step (resident first); the memory of 1 vs 3 teachers is
  tests/test_bench.py's (bench.py teachers);
* routing: each token of a hand-built two-turn trajectory goes to the teacher its route function names
  (pure and through the actor), and an ensemble target is the hand-computed mixture log(.25 p0 + .75 p1);
* a few steps lower the student's KL to its teacher, PG-style (gkd_ratio 0) and GKD-style (gkd_ratio 1);
* bad input: unknown teacher names, a source without a teacher, a teacher with another vocabulary,
  meaningless ratio combinations: clear errors at config time, before anything starts;
* data sources: batches mixed by weight with exact shares.
* without /proc (macOS), a teacher starts, scores and reports its memory as 0 MB (unknown).
"""
import json
import math
from pathlib import Path

import pytest
import ray
import torch

import algos
import config
import convert
import data
import loongsage
import teacher
import trainer
import transfermesh
from config import Config

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(600)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=128)


@pytest.fixture(scope="module")
def second_teacher_dir() -> str:
    """Same architecture and tokenizer as `tiny_model_dir`, other random weights (seed 1)."""
    return data.build_tiny_model(data.default_cache_dir() / "tiny-test-seed1", **TINY, seed=1)


def _port() -> int:
    return transfermesh.free_port("127.0.0.1")


def make_cfg(**over) -> Config:
    base = dict(device="cpu", dtype="float32", seed=0, tensor_parallel=1, pipeline_parallel=1, trainer_workers=1,
                prompts_per_step=4, samples_per_prompt=2, global_batch_size=8, micro_batch_size=4, num_steps=10,
                lr=1e-2, min_lr=1e-2, grad_clip=1.0, max_new_tokens=8, teacher_topk=4, teacher_micro_batch=3)
    base.update(over)
    return Config(**base)


def make_batch(tok, n=8, seed=0) -> list[dict]:
    """n one-turn trajectories: arithmetic prompts, a few response tokens each (different lengths)."""
    out = []
    for i, s in enumerate(data.arith_samples(n, seed)):
        r = tok.encode(s["answer"] + " ok", add_special_tokens=False)[: 2 + i % 3]
        out.append({"prompt_ids": data.prompt_ids(tok, s), "response_ids": r, "loss_mask": [1] * len(r),
                    "rollout_logprobs": [], "weight_versions": [0] * len(r), "reward": 0.0, "status": "ok",
                    "group_id": i // 2, "sample_index": i % 2, "metadata": {}})
    return out


def start_teacher(cfg, paths: dict[str, str], tmp) -> object:
    a = ray.remote(num_cpus=1)(teacher.TeacherWorker).remote(cfg, 0, 1, "127.0.0.1", _port())
    ray.get(a.load_teachers.remote(paths, str(tmp)))
    return a


def two_turn(tok, route=None) -> dict:
    """A hand-built two-turn trajectory: model turn (3 tokens), tool output (2, masked), model turn (2)."""
    s = data.arith_samples(1, 5)[0]
    ids = tok.encode("12 + 3 = 15 ok", add_special_tokens=False)[:7]
    return {"prompt_ids": data.prompt_ids(tok, s), "response_ids": ids, "loss_mask": [1, 1, 1, 0, 0, 1, 1],
            "rollout_logprobs": [], "weight_versions": [0] * 7, "reward": 0.0, "status": "ok", "group_id": 0,
            "sample_index": 0, "metadata": {"teacher": route}}


def route_by_turn(traj: dict) -> list:
    """Route function (dotted path tests.test_teacher.route_by_turn): turn 1 -> t0, turn 2 -> t1."""
    out = [None] * len(traj["response_ids"])
    for k, (a, b) in enumerate(teacher.model_turns(traj)):
        out[a:b] = [("t0", "t1")[min(k, 1)]] * (b - a)
    return out


# ---------------------------------------------------------------------------------------- parity and targets


@pytest.mark.slow
def test_teacher_logprobs_equal_the_trainers(ray_session, tiny_model_dir, tmp_path):
    cfg = make_cfg(teachers={"t0": tiny_model_dir}, pg_ratio=1.0)
    batch = make_batch(data.load_tokenizer(tiny_model_dir))
    # the trainer rank starts while the teacher does (an actor's start-up is one core's work: two overlap on two)
    tr = ray.remote(num_cpus=1)(trainer.TrainerWorker).remote(cfg, 0, 1, "127.0.0.1", _port())
    te = start_teacher(cfg, {"t0": tiny_model_dir}, tmp_path)
    targets, m = ray.get(te.score.remote(batch))
    ray.kill(te)
    ray.get(tr.load_hf.remote(tiny_model_dir))
    want = ray.get(tr.compute_logprobs.remote(batch))
    ray.kill(tr)
    for tg, w in zip(targets, want):
        assert torch.allclose(tg["teacher_logp"], torch.tensor(w), atol=1e-6, rtol=0)
        assert tg["teacher_mask"].tolist() == [1.0] * len(w)
        # top-k is sorted, and the sampled token's logprob is at most the top-1
        assert (tg["teacher_topk_logp"][:, :-1] >= tg["teacher_topk_logp"][:, 1:]).all()
        assert (tg["teacher_logp"] <= tg["teacher_topk_logp"][:, 0] + 1e-6).all()
    assert m["teacher/swaps"] == 0 and m["teacher/t0/tokens"] == sum(len(w) for w in want)


@pytest.mark.slow
def test_a_teacher_starts_and_scores_where_proc_cannot_be_read(ray_session, tiny_model_dir, tmp_path):
    """macOS has no /proc: with every /proc open failing, a teacher still starts, loads, scores (finite logprobs on
    every response token, each at most its top-1) and reports its memory as 0 MB (unknown), not a crash."""
    def without_proc(cfg, path: str, snap_dir: str, port: int, batch: list[dict]) -> tuple:
        """In a Ray worker of its own (max_calls=1: the worker exits after it): every open of a /proc path fails as it
        does on macOS, then a teacher starts, loads `path`, scores `batch` and reports its memory. Returns the load
        answer, the targets, the metrics, the memory answer and the /proc paths refused."""
        import builtins
        import io
        real, refused = builtins.open, []

        def no_proc(file, *args, **kw):
            if str(file).startswith("/proc"):
                refused.append(str(file))
                raise FileNotFoundError(2, "No such file or directory (no /proc, as on macOS)", str(file))
            return real(file, *args, **kw)
        builtins.open = io.open = no_proc  # io.open: pathlib's read_text goes through it
        w = teacher.TeacherWorker(cfg, 0, 1, "127.0.0.1", port)
        loaded = w.load_teachers({"t0": path}, snap_dir)
        targets, m = w.score(batch)
        return loaded, targets, m, w.memory(), refused

    cfg = make_cfg(teachers={"t0": tiny_model_dir}, pg_ratio=1.0)
    batch = make_batch(data.load_tokenizer(tiny_model_dir))
    run = ray.remote(num_cpus=1, max_calls=1)(without_proc)  # nested: shipped by value, the test module stays here
    loaded, targets, m, memory, refused = ray.get(run.remote(cfg, tiny_model_dir, str(tmp_path), _port(), batch))
    assert any(p.startswith("/proc/self/") for p in refused), refused  # the reads were made, and failed
    assert loaded["teachers"] == ["t0"] and loaded["rss_mb"] == loaded["peak_rss_mb"] == loaded["base_rss_mb"] == 0
    assert memory["rss_mb"] == memory["peak_rss_mb"] == 0 and m["teacher/peak_rss_mb"] == 0
    assert m["teacher/t0/tokens"] == sum(len(t["response_ids"]) for t in batch)
    for tg, t in zip(targets, batch):
        assert tg["teacher_logp"].shape == (len(t["response_ids"]),) and torch.isfinite(tg["teacher_logp"]).all()
        assert (tg["teacher_logp"] <= tg["teacher_topk_logp"][:, 0] + 1e-6).all()


@pytest.fixture(scope="module")
def full_vocab_targets(ray_session, tiny_model_dir, tmp_path_factory):
    """One teacher's targets (hidden states, and its top-V = every id, sorted) and LM head for make_batch, shared by
    the three divergences below: a teacher sends the same for any full-vocabulary distill_type (teacher.needs_hidden
    is all it asks of distill_type), so one teacher actor serves all three."""
    V = convert.read_hf_config(tiny_model_dir)["vocab_size"]
    cfg = make_cfg(teachers={"t0": tiny_model_dir}, gkd_ratio=1.0, distill_type="forward_kl", teacher_topk=V)
    te = start_teacher(cfg, {"t0": tiny_model_dir}, tmp_path_factory.mktemp("teacher"))
    targets, _ = ray.get(te.score.remote(make_batch(data.load_tokenizer(tiny_model_dir))))
    heads = ray.get(te.lm_heads.remote())
    ray.kill(te)
    return targets, heads


@pytest.mark.parametrize("div", ["forward_kl", "reverse_kl", "jsd"])
@pytest.mark.slow
def test_hidden_states_with_lm_head_on_the_student_side_equal_full_logits(div, full_vocab_targets, tiny_model_dir):
    V = convert.read_hf_config(tiny_model_dir)["vocab_size"]
    cfg = make_cfg(teachers={"t0": tiny_model_dir}, gkd_ratio=1.0, distill_type=div, teacher_topk=V)
    batch = make_batch(data.load_tokenizer(tiny_model_dir))
    targets, heads = full_vocab_targets
    assert set(targets[0]["teacher_hidden"]) == {"t0"} and heads["t0"].shape[0] == V
    # the student side, as the trainer runs it (no distributed state needed at TP=1)
    mb = trainer.collate(batch, {"adv": [torch.zeros(len(s["response_ids"])) for s in batch]})
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(*mb["loss_mask"].shape, V, generator=g)  # (B, R, V) a student
    logp = torch.log_softmax(logits, -1).gather(-1, mb["tokens"].gather(1, mb["resp_pos"] + 1).unsqueeze(-1)).squeeze(-1)
    denom = algos.global_denominators(mb["loss_mask"].sum(-1).tolist(), 8)
    got = trainer.opd_terms(cfg, mb, logp, logits, targets, denom, heads)["gkd_loss"]
    # reference: the teacher's full distribution, rebuilt from its top-V (all ids, sorted) targets
    full = trainer.collate_targets(targets, mb["loss_mask"].size(1))
    t_logp = torch.full_like(logits, -math.inf).scatter(-1, full["teacher_topk_ids"], full["teacher_topk_logp"])
    want, _ = algos.distill_loss(cfg, logits, mb["loss_mask"], denom, teacher_logits=t_logp)
    assert want > 0.01
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (float(got), float(want))


# ---------------------------------------------------------------------------------------- memory and swaps


@pytest.mark.slow
def test_swaps_per_step_with_interleaved_teachers(ray_session, tiny_model_dir, second_teacher_dir, tmp_path):
    cfg = make_cfg(teachers={"t0": tiny_model_dir, "t1": second_teacher_dir}, pg_ratio=1.0)
    batch = make_batch(data.load_tokenizer(tiny_model_dir))
    for i, s in enumerate(batch):
        s["metadata"]["teacher"] = ("t0", "t1")[i % 2]  # interleaved: grouping by teacher is what saves swaps
    te = start_teacher(cfg, {"t0": tiny_model_dir, "t1": second_teacher_dir}, tmp_path)
    swaps = [ray.get(te.score.remote(batch))[1]["teacher/swaps"] for _ in range(3)]
    ray.kill(te)
    assert swaps == [1, 1, 1]  # t1 is resident after loading; each step: resident first, then one swap


# ---------------------------------------------------------------------------------------- routing


def test_token_routes_two_turns_and_ensembles(tiny_model_dir):
    tok = data.load_tokenizer(tiny_model_dir)
    W = teacher.token_routes(two_turn(tok), ["t0", "t1"], route_by_turn)
    assert W.tolist() == [[1, 0], [1, 0], [1, 0], [0, 0], [0, 0], [0, 1], [0, 1]]
    W = teacher.token_routes(two_turn(tok, {"t0": 1, "t1": 3}), ["t0", "t1"])
    assert W.tolist() == [[.25, .75]] * 3 + [[0, 0]] * 2 + [[.25, .75]] * 2
    with pytest.raises(ValueError, match="unknown teacher 'nope'.*teachers are \\['t0', 't1'\\]"):
        teacher.token_routes(two_turn(tok, "nope"), ["t0", "t1"])
    with pytest.raises(ValueError, match="has no teacher and there are 2"):
        teacher.token_routes(two_turn(tok), ["t0", "t1"])
    with pytest.raises(ValueError, match="returned 2 entries for 7 response tokens"):
        teacher.token_routes(two_turn(tok), ["t0", "t1"], lambda traj: ["t0", "t1"])


@pytest.mark.slow
def test_per_token_routing_and_ensemble_targets_through_the_actor(ray_session, tiny_model_dir, second_teacher_dir,
                                                                  tmp_path):
    tok = data.load_tokenizer(tiny_model_dir)
    paths = {"t0": tiny_model_dir, "t1": second_teacher_dir}
    single = start_teacher(make_cfg(teachers=paths, pg_ratio=1.0), paths, tmp_path / "a")
    (only0, only1), _ = ray.get(single.score.remote([two_turn(tok, "t0"), two_turn(tok, "t1")]))
    (mix,), _ = ray.get(single.score.remote([two_turn(tok, {"t0": 0.25, "t1": 0.75})]))
    ray.kill(single)
    routed = start_teacher(make_cfg(teachers=paths, pg_ratio=1.0, teacher_route="tests.test_teacher.route_by_turn"),
                           paths, tmp_path / "b")
    (by_turn,), m = ray.get(routed.score.remote([two_turn(tok)]))
    ray.kill(routed)
    p0, p1 = only0["teacher_logp"], only1["teacher_logp"]
    assert (p0 - p1)[[0, 1, 2, 5, 6]].abs().min() > 1e-3  # the two teachers really differ
    # per token: turn 1 (tokens 0-2) from t0, tool tokens 3-4 from nobody, turn 2 (5-6) from t1
    want = torch.cat([p0[:3], torch.zeros(2), p1[5:]])
    assert torch.allclose(by_turn["teacher_logp"], want, atol=1e-6)
    assert by_turn["teacher_mask"].tolist() == [1, 1, 1, 0, 0, 1, 1]
    assert m["teacher/t0/tokens"] == 3 and m["teacher/t1/tokens"] == 2
    # ensemble: log(.25 p0 + .75 p1) on the sampled token; its top-1 is the mixture's mode
    model = [0, 1, 2, 5, 6]
    hand = torch.log(0.25 * p0.exp() + 0.75 * p1.exp())
    assert torch.allclose(mix["teacher_logp"][model], hand[model], atol=1e-5)


def test_topk_targets_in_chunks_and_vocab_shards_equal_the_full_log_softmax(monkeypatch):
    """Top-k targets without a full-vocabulary log-softmax: chunks of rows (here 7 rows a chunk, 50 rows), and a
    vocabulary split over 1, 2 or 4 TP shards merged from each shard's top k and log-sum-exp alone, give the
    full path's ids exactly and its log-probs to fp32 rounding, k up to the whole vocabulary."""
    from types import SimpleNamespace
    g = torch.Generator().manual_seed(0)
    logits = 4 * torch.randn(50, 96, generator=g)  # (n, V)
    monkeypatch.setattr(teacher, "CHUNK_FLOATS", 7 * 96)
    for k in (1, 5, 96):
        full = torch.log_softmax(logits, -1).topk(k, -1)
        chunked = teacher.TeacherWorker._topk(SimpleNamespace(par=SimpleNamespace(tp_rank=0, tp_size=1)), logits, k)
        for v, i in (chunked, *(teacher.merge_vocab_topk(
                [teacher.vocab_topk(shard, k, r * shard.size(-1)) for r, shard in enumerate(logits.chunk(tp, -1))], k)
                for tp in (2, 4))):
            assert torch.equal(i, full.indices), k
            assert torch.allclose(v, full.values, atol=1e-5, rtol=0), (k, (v - full.values).abs().max())


# ---------------------------------------------------------------------------------------- learning


@pytest.mark.parametrize("style", ["pg", "gkd"])
@pytest.mark.slow
def test_a_few_opd_steps_lower_the_students_kl_to_its_teacher(style, ray_session, tiny_model_dir, second_teacher_dir,
                                                              tmp_path):
    """Student = tiny_model_dir, teacher = another random init. PG-style: zero rewards, so A' = -KL_token
    alone; the k3 KL on the sampled tokens falls. GKD-style (gkd_ratio=1): the top-k KL falls."""
    over = dict(pg_ratio=1.0, advantage="grpo", adv_norm="none") if style == "pg" else dict(gkd_ratio=1.0)
    cfg = make_cfg(teachers={"t": second_teacher_dir}, teacher_topk=16, lr=3e-3, min_lr=3e-3, **over)
    batch = make_batch(data.load_tokenizer(tiny_model_dir))
    tr = ray.remote(num_cpus=1)(trainer.TrainerWorker).remote(cfg, 0, 1, "127.0.0.1", _port())  # starts meanwhile
    te = start_teacher(cfg, {"t": second_teacher_dir}, tmp_path)
    targets, _ = ray.get(te.score.remote(batch))
    ray.kill(te)
    ray.get(tr.load_hf.remote(tiny_model_dir))
    key = "train/opd_kl" if style == "pg" else "train/opd_loss"
    hist = [ray.get(tr.train_step.remote(batch, i, targets)) for i in range(6)]
    ray.kill(tr)
    kl = [h[key] for h in hist]
    assert all(math.isfinite(k) for k in kl) and kl[0] > 0.01
    assert kl[-1] < 0.6 * kl[0], kl


# ---------------------------------------------------------------------------------------- config errors


def _load(tmp_path, **over):
    raw = {"model_path": "tiny", "pg_ratio": 1.0, **over}
    path = tmp_path / "r.yaml"
    path.write_text(json.dumps(raw))
    return config.load_config(str(path))


def test_bad_teacher_config_fails_before_anything_starts(tmp_path, tiny_model_dir):
    two = {"a": {"path": "tiny"}, "b": {"path": "tiny"}}
    src = {"name": "add", "dataset": "synthetic:add:8:1:9"}
    with pytest.raises(ValueError, match="names teacher 'c', which is not in teachers: \\['a', 'b'\\]"):
        _load(tmp_path, teachers=two, data_sources=[{**src, "teacher": "c"}])
    with pytest.raises(ValueError, match="data source 'add' has no teacher, and there are 2 teachers"):
        _load(tmp_path, teachers=two, data_sources=[src])
    with pytest.raises(ValueError, match="teacher 'a' .* has another vocabulary"):
        _load(tmp_path, teachers={"a": {"path": "tiny", "tiny_model": {"tokenizer_vocab": 320}}})
    with pytest.raises(ValueError, match="teacher 't' .* has another vocabulary"):  # an HF dir: vocab_size differs
        other = data.build_tiny_model(tmp_path / "wide", **TINY, vocab_multiple=256)
        _load(tmp_path, model_path=tiny_model_dir, teachers={"t": other})
    with pytest.raises(ValueError, match="teach nothing"):
        _load(tmp_path, teachers={"a": {"path": "tiny"}}, pg_ratio=0.0)
    with pytest.raises(ValueError, match="`teachers:` is empty"):
        _load(tmp_path, gkd_ratio=0.5)
    with pytest.raises(ValueError, match="teachers.a.warmstart_step is not a teacher setting; did you mean 'warmstart_steps'"):
        _load(tmp_path, teachers={"a": {"path": "tiny", "warmstart_step": 3}})
    cfg = _load(tmp_path, teachers=two, data_sources=[{**src, "teacher": {"a": 1, "b": 1}}])  # an ensemble is fine
    # a sample's own teacher field: checked when the data is loaded, before any actor
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": "1+1", "answer": "2", "teacher": "zed"}) + "\n")
    cfg = _load(tmp_path, teachers=two, teacher_route="", data_sources=[{"name": "x", "dataset": str(rows), "teacher": "a"}])
    with pytest.raises(ValueError, match="names teacher 'zed', which is not in teachers"):
        loongsage.load_data(cfg)


def test_the_prompt_stream_follows_the_source_weights(tmp_path):
    cfg = _load(tmp_path, teachers={"a": {"path": "tiny"}}, prompts_per_step=4, global_batch_size=32, micro_batch_size=32, data_sources=[
        {"name": "add", "dataset": "synthetic:add:50:1:9", "weight": 1, "eval_dataset": "synthetic:add:5:2:9"},
        {"name": "sub", "dataset": "synthetic:sub:50:3:9", "weight": 3}])
    samples, eval_sets = loongsage.load_data(cfg)
    assert {s["source"] for s in eval_sets[""]} == {"add"} and len(samples) == 100 and list(eval_sets) == [""]
    it = loongsage.prompt_stream(cfg, samples)  # the producer's stream: each source gets its share in order
    steps = [[next(it)[1] for _ in range(4)] for _ in range(6)]
    assert all([s["source"] for s in b].count("sub") == 3 and len(b) == 4 for b in steps)
    cfg.prompts_per_step, cfg.data_sources[1]["weight"] = 3, 1  # 1.5 each: the remainder alternates
    it = loongsage.prompt_stream(cfg, samples)
    counts = [[next(it)[1]["source"] for _ in range(3)].count("add") for _ in range(4)]
    assert sorted(counts) == [1, 1, 2, 2] and sum(counts) == 6
    ops = {s["messages"][0]["content"][1] for s in samples if s["source"] == "sub"}
    assert ops == {"-"}


# ---------------------------------------------------------------------------------------- end to end


@pytest.mark.slow
def test_mopd_recipe_end_to_end_short(tmp_path, run_cache, ray_session):
    """recipes/mopd_cpu.yaml shrunk (2 teachers built with 2 SFT steps each, 2 steps), with a
    full-vocabulary divergence so the hidden-state targets and the LM heads travel too: teachers are
    evaluated per source, every step swaps at most once per teacher, the opd metrics are finite, the
    plot is written."""
    build = {"warmstart_steps": 2, "warmstart_batch_size": 8, "tiny_model": TINY}
    teachers = {"add_teacher": {"path": "tiny", "warmstart_dataset": "synthetic:add:64:11:9", **build},
                "sub_teacher": {"path": "tiny", "warmstart_dataset": "synthetic:sub:64:12:9", **build}}
    cfg = config.load_config(str(ROOT / "recipes/mopd_cpu.yaml"), [
        f"output_dir={tmp_path}/run", "num_steps=2", "prompts_per_step=4", "samples_per_prompt=2",
        "global_batch_size=8", "micro_batch_size=4", "eval_every=1", "warmstart_steps=2", "warmstart_batch_size=8",
        f"tiny_model={json.dumps(TINY)}", f"teachers={json.dumps(teachers)}", "distill_type=forward_kl",
        "data_sources=" + json.dumps([
            {"name": "add", "dataset": "synthetic:add:64:1:9", "eval_dataset": "synthetic:add:6:2:9", "teacher": "add_teacher"},
            {"name": "sub", "dataset": "synthetic:sub:64:3:9", "eval_dataset": "synthetic:sub:6:4:9", "teacher": "sub_teacher"}])])
    history = loongsage.train(cfg)
    first = history[0]
    assert {f"teacher/{t}/{s}/accuracy" for t in ("add_teacher", "sub_teacher") for s in ("add", "sub")} <= set(first)
    steps = [h for h in history if "train/loss" in h]
    assert len(steps) == 2
    for h in steps:
        assert h["teacher/teachers_used"] == 2 and h["teacher/swaps"] <= 2
        assert h["teacher/add_teacher/tokens"] > 0 and h["teacher/sub_teacher/tokens"] > 0
        assert h["rollout/add/reward_mean"] >= 0 and "eval/sub/accuracy" in h
        assert all(math.isfinite(h[k]) for k in ("train/opd_loss", "train/opd_kl", "train/opd_pg_kl", "train/loss"))
        assert h["train/opd_loss"] > 0 and h["train/opd_tokens"] == 1.0
    assert (tmp_path / "run" / "reward_curve.png").stat().st_size > 1000
