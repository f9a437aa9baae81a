"""Extension points (docs/EXTENDING.md): each one plugged in by dotted path from a user module that lives
outside the repository (written into tmp_path and put on sys.path, or on PYTHONPATH for Ray actors), and shown to
be really used: every user function here produces a number or a behaviour no built-in produces.

In-process where the core calls the extension in-process (algos, the producer's window and filter, AgentFlow and
its router, the sandbox, the engine launcher, the weight push); the policy loss and KL estimator run inside a real
trainer actor (Ray, Megatron-Core over gloo). Real parts throughout: CPU engines over HTTP, the official openai
client. The one test double is test_agentflow's `crafted_engine`, for the tool-parser check (the random tiny
model never writes a tool call). `.venv/bin/pytest tests/test_extensions.py -q`.
"""
import json
import os
import textwrap
from pathlib import Path

import httpx
import openai
import pytest
import ray
import torch
from safetensors.torch import load_file

import agentflow
import algos
import config
import cpu_engine
import data
import loongsage
import rollout
import teacher
import trainer
import transfermesh
from test_agentflow import CALC_TOOL, SAMPLING, crafted_engine, engines, make_cfg, run  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]


def plug(tmp_path: Path, monkeypatch, name: str, source: str) -> str:
    """Write the user's module `name` into tmp_path (outside the repo) and put that directory on sys.path."""
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


# ----------------------------------------------------------------------------------------------
# the resolver


def test_resolver_takes_both_spellings_and_names_what_failed(tmp_path, monkeypatch):
    mod = plug(tmp_path, monkeypatch, "userext_resolve", """
        class Scorer:
            @staticmethod
            def score(text, sample):
                return 0.5
        """)
    assert data.import_object(f"{mod}:Scorer.score")("", {}) == 0.5
    assert data.import_object(f"{mod}.Scorer").score("", {}) == 0.5
    with pytest.raises(ValueError, match="userext_resolve:nothing"):
        data.import_object(f"{mod}:nothing")
    with pytest.raises(ValueError, match="not a dotted path"):
        data.import_object("grpo")


# ----------------------------------------------------------------------------------------------
# agent, reward, sandbox, chat template / tool parser: AgentFlow and its router, on real CPU engines


def test_reward_by_dotted_path(engines, tiny_model_dir, tmp_path, monkeypatch):
    mod = plug(tmp_path, monkeypatch, "userext_reward", """
        def score(response_text, sample):
            return 0.25 + len(sample["answer"]) / 100   # exact_match only gives 0 or 1
        """)
    samples = data.arith_samples(2, seed=3)

    async def body():
        flow = agentflow.AgentFlow(make_cfg(reward=f"{mod}:score"), engines, tiny_model_dir)
        out = await flow.generate(samples, 2, SAMPLING, step=0)
        await flow.close()
        return out
    out = run(body())
    want = {i: 0.25 + len(s["answer"]) / 100 for i, s in enumerate(samples)}
    assert sorted(t["reward"] for t in out) == sorted(want[i] for i in range(2) for _ in range(2))


def test_agent_by_dotted_path(engines, tiny_model_dir, tmp_path, monkeypatch):
    mod = plug(tmp_path, monkeypatch, "userext_agent", """
        async def agent(client, sample):
            first = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "a"}],
                                                         max_tokens=2)
            await client.chat.completions.create(model="m", max_tokens=2, messages=[
                {"role": "user", "content": "a"}, {"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "b"}])
            return {"reward": 0.375, "answer": "x"}
        """)

    async def body():
        flow = agentflow.AgentFlow(make_cfg(agent=f"{mod}.agent"), engines, tiny_model_dir)
        out = await flow.generate(data.arith_samples(1, seed=1), 2, SAMPLING, step=0)
        await flow.close()
        return out
    out = run(body())
    assert [t["status"] for t in out] == ["ok", "ok"]
    assert [t["reward"] for t in out] == [0.375, 0.375]  # the agent's own reward, not exact_match's 0/1
    assert [t["metadata"]["turns"] for t in out] == [2, 2]  # the two calls it made went through its session


def test_sandbox_by_dotted_path(engines, tiny_model_dir, tmp_path, monkeypatch):
    mod = plug(tmp_path, monkeypatch, "userext_sandbox", """
        import dataclasses
        import sandbox

        class Tagged(sandbox.LocalSandbox):
            async def execute(self, command, **kw):
                r = await super().execute(command, **kw)
                return dataclasses.replace(r, stdout="boxed:" + r.stdout)

        def make(**limits):
            return Tagged(**limits)
        """)
    cfg = make_cfg(agent_command='printf %s "$LOONGSAGE_TASK" | wc -c', sandbox=f"{mod}:make")

    async def body():
        flow = agentflow.AgentFlow(cfg, engines, tiny_model_dir)
        out = await flow.generate(data.arith_samples(1, seed=2), 1, SAMPLING, step=0)
        await flow.close()
        return out
    [t] = run(body())
    task = data.task_text(data.arith_samples(1, seed=2)[0])
    assert t["response_text"] == f"boxed:{len(task.encode())}"  # the program ran, and through the user's sandbox


def test_chat_template_and_tool_parser_by_dotted_path(engines, tiny_model_dir, tmp_path, monkeypatch):
    mod = plug(tmp_path, monkeypatch, "userext_chat", """
        TEMPLATE = (
            "{% for m in messages %}<|im_start|>{{ m.role }}\\n[{{ m.content }}]<|im_end|>\\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\\n{% endif %}")

        def parse(text, tool_names):
            # 'CALL name arg': a format the built-in <tool_call> parser does not read
            if not text.startswith("CALL "):
                return text.strip(), []
            _, name, arg = text.split(" ", 2)
            return "", [{"id": "call_user1", "type": "function",
                         "function": {"name": name, "arguments": {"expression": arg.strip()}}}]
        """)
    cfg = make_cfg(chat_template=f"{mod}:TEMPLATE", tool_parser=f"{mod}:parse")

    async def body():
        flow = agentflow.AgentFlow(cfg, engines, tiny_model_dir)
        await flow.start_router()
        seen = crafted_engine(flow.pool, flow.chat, ["CALL calculator 12+7"])
        s = flow.router.open_session(sampling=SAMPLING, max_context_len=512, max_turns=4)
        client = openai.AsyncOpenAI(base_url=flow.router.base_url(s), api_key=s.api_key, max_retries=0)
        r = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "12+7?"}],
                                                 tools=[CALC_TOOL])
        await flow.close()
        return flow.chat.decode(seen[0], skip_special_tokens=False), r
    prompt, r = run(body())
    assert prompt == "<|im_start|>user\n[12+7?]<|im_end|>\n<|im_start|>assistant\n"  # the user's template
    [call] = r.choices[0].message.tool_calls
    assert (call.id, call.function.name, json.loads(call.function.arguments)) == \
        ("call_user1", "calculator", {"expression": "12+7"})
    assert r.choices[0].finish_reason == "tool_calls"


# ----------------------------------------------------------------------------------------------
# algos: advantage and distillation divergence in-process; policy loss and KL inside a trainer actor


def test_advantage_by_dotted_path(tmp_path, monkeypatch):
    mod = plug(tmp_path, monkeypatch, "userext_adv", """
        import torch

        def adv(cfg, rewards, group_ids, loss_mask, **kw):
            T = loss_mask.shape[1]
            return rewards[:, None] * 10 + torch.arange(T, dtype=torch.float32)[None, :]   # (B, T)
        """)
    cfg = config.Config(advantage=f"{mod}:adv")
    algos.validate(cfg)
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    got = algos.compute_advantages(cfg, torch.tensor([1.0, -1.0]), torch.tensor([0, 0]), mask)
    assert got.tolist() == [[10.0, 11.0, 0.0], [-10.0, 0.0, -8.0]]  # the user's numbers, 0 off the loss mask
    with pytest.raises(ValueError, match="userext_adv:missing"):
        algos.validate(config.Config(advantage=f"{mod}:missing"))
    with pytest.raises(ValueError, match="or a dotted path"):  # a typo of a built-in still gets the choices
        algos.validate(config.Config(advantage="grpoo"))


def test_distill_divergence_by_dotted_path(tmp_path, monkeypatch):
    mod = plug(tmp_path, monkeypatch, "userext_div", """
        def l1(student_logits, teacher_logits=None, **kw):
            return (student_logits - teacher_logits).abs().sum(-1)   # (B, T)
        """)
    cfg = config.Config(distill_type=f"{mod}.l1")
    algos.validate(cfg)
    student, teacher_logits = torch.zeros(1, 2, 3), torch.ones(1, 2, 3)
    mask = torch.tensor([[1, 1]])
    value, m = algos.distill_loss(cfg, student, mask, algos.global_denominators(mask.sum(-1).tolist(), 2),
                                  teacher_logits=teacher_logits)
    assert float(value) == 3.0 and float(m[f"distill_{mod}.l1"]) == 3.0  # the trainer reads this key  # |0 - 1| * 3 vocab entries, token mean


@pytest.fixture(scope="module")
def user_actor_dir(tmp_path_factory):
    """A directory outside the repo with the user's loss and KL, on the Ray workers' PYTHONPATH."""
    d = tmp_path_factory.mktemp("userext_actor")
    (d / "userext_trainer.py").write_text(textwrap.dedent("""
        def loss(cfg, logp, old_logp, adv, mask):
            return 0.0 * logp + 7.0          # (B, T): a per-token loss of exactly 7

        def kl(logp, ref_logp):
            return 0.0 * logp + 0.25         # (B, T): a per-token KL of exactly 0.25
        """))
    return d


@pytest.mark.slow
def test_policy_loss_and_kl_by_dotted_path_in_a_trainer_actor(ray_session, user_actor_dir, tiny_model_dir,
                                                               monkeypatch):
    from test_trainer import make_batch, make_cfg as trainer_cfg
    monkeypatch.syspath_prepend(str(user_actor_dir))  # validate() imports them in this process too
    cfg = trainer_cfg(policy_loss="userext_trainer:loss", kl_type="userext_trainer:kl", kl_coef=0.05)
    algos.validate(cfg)
    port = transfermesh.free_port("127.0.0.1")
    # the user's directory on this actor's PYTHONPATH only: the session's Ray stays as it is
    env = {"env_vars": {"PYTHONPATH": f"{ROOT}{os.pathsep}{user_actor_dir}", "TOKENIZERS_PARALLELISM": "false"}}
    worker = ray.remote(num_cpus=1)(trainer.TrainerWorker).options(runtime_env=env).remote(cfg, 0, 1, "127.0.0.1",
                                                                                            port)
    try:
        ray.get(worker.load_hf.remote(tiny_model_dir))
        m = ray.get(worker.train_step.remote(make_batch(), 0))
        ray.get(worker.shutdown.remote())
    finally:
        ray.kill(worker)
    assert m["train/pg_loss"] == pytest.approx(7.0, abs=1e-6)   # no built-in loss is a constant 7
    assert m["train/kl"] == pytest.approx(0.25, abs=1e-6)


# ----------------------------------------------------------------------------------------------
# the controller's producer: group filter and window strategy


def finished(seq: int, rewards: list[float]) -> dict:
    trajs = [{"reward": r, "loss_mask": [1], "weight_versions": [0], "rollout_logprobs": [0.0]} for r in rewards]
    return {"seq": seq, "trajs": trajs, "aborted": False}


def test_group_filter_by_dotted_path(tmp_path, monkeypatch):
    mod = plug(tmp_path, monkeypatch, "userext_filter", """
        def keep(group):
            return sum(t["reward"] for t in group) >= 1.5   # a rule of the user's: total reward at least 1.5
        """)
    cfg = config.Config(group_filter=f"{mod}:keep", prompts_per_step=2, samples_per_prompt=2, stale_steps=0.0)
    p = loongsage.Producer(cfg, data.arith_samples(8, seed=0))
    seqs = [seq for seq, _ in p.dispatch()]
    assert seqs == [0, 1]
    p.receive([finished(0, [1.0, 0.0]), finished(1, [1.0, 1.0])], version=0)  # dynamic_sampling would keep both
    assert [[t["reward"] for t in g] for g in p.batch] == [[1.0, 1.0]] and p.stats["dropped"] == 1
    assert not p.full()


def test_dynamic_sampling_drops_groups_of_equal_rewards():
    """DAPO dynamic sampling on the Producer's own path: a group whose rewards are all equal (binary or graded) is
    dropped and counted (its prompt is not trained on); a group with any two different rewards is kept."""
    cfg = config.Config(dynamic_sampling=True, prompts_per_step=4, samples_per_prompt=3, stale_steps=0.0)
    p = loongsage.Producer(cfg, data.arith_samples(8, seed=0))
    assert [seq for seq, _ in p.dispatch()] == [0, 1, 2, 3]
    p.receive([finished(0, [1.0, 1.0, 1.0]), finished(1, [0.0, 1.0, 0.0]), finished(2, [0.5, 0.5, 0.5]),
               finished(3, [2.0, 2.5, 2.0])], version=0)
    assert [[t["reward"] for t in g] for g in p.batch] == [[0.0, 1.0, 0.0], [2.0, 2.5, 2.0]]
    assert p.stats["dropped"] == 2 and not p.full()
    metrics = p.pop_batch()[1]
    assert (metrics["rollout/groups_kept"], metrics["rollout/groups_sampled"]) == (2, 4) and not p.prompt_of


def test_window_by_dotted_path(tmp_path, monkeypatch):
    mod = plug(tmp_path, monkeypatch, "userext_window", """
        class OneAtATime:
            # dispatch one group at a time; collect only even sequence numbers
            @staticmethod
            def groups_to_dispatch(C, R, Q, next_seq, oldest_uncollected):
                return 1 if R + Q < C else 0

            @staticmethod
            def collectable(finished, min_unfinished, oldest_uncollected, B, C):
                return sorted(s for s in finished if s % 2 == 0)
        """)
    cfg = config.load_config(None, [f"window={mod}:OneAtATime", "mode=async", "prompts_per_step=2",
                                    "samples_per_prompt=2", "global_batch_size=4", "micro_batch_size=2"])
    p = loongsage.Producer(cfg, data.arith_samples(8, seed=0))
    assert [seq for seq, _ in p.dispatch()] == [0]   # every built-in window would start C = 4 groups
    assert [seq for seq, _ in p.dispatch()] == [1]
    p.receive([finished(0, [1.0, 0.0]), finished(1, [1.0, 0.0])], version=0)
    assert sorted(p.finished) == [1] and len(p.batch) == 1  # seq 1 waits: the user's window holds odd ones back
    with pytest.raises(ValueError, match="window="):
        config.load_config(None, ["window=window-gatd"])


# ----------------------------------------------------------------------------------------------
# teacher routing, engine, weight transport


def test_teacher_route_by_dotted_path(tmp_path, monkeypatch):
    mod = plug(tmp_path, monkeypatch, "userext_route", """
        def route(traj):
            # the first half of the response to teacher a, the rest split 3:1 between a and b
            R = len(traj["response_ids"])
            return ["a" if t < R // 2 else {"a": 3, "b": 1} for t in range(R)]
        """)
    cfg = config.Config(teacher_route=f"{mod}:route")
    traj = {"response_ids": [5, 6, 7, 8], "loss_mask": [1, 1, 0, 1], "group_id": 0}
    W = teacher.token_routes(traj, ["a", "b"], data.import_object(cfg.teacher_route))  # as TeacherWorker loads it
    assert W.tolist() == [[1.0, 0.0], [1.0, 0.0], [0.0, 0.0], [0.75, 0.25]]


def test_engine_by_dotted_path(tiny_model_dir, tmp_path, monkeypatch):
    mod = plug(tmp_path, monkeypatch, "userext_engine", f"""
        import json

        import cpu_engine

        def start(cfg, rank, host, seed):
            # the CPU engine with settings of the user's choosing; any server on SGLang's HTTP contract would do
            url, handle = cpu_engine.serve(cfg.model_path, host=host, max_batch=2, max_len=64, seed=seed)
            open({str(tmp_path / "calls.json")!r}, "w").write(json.dumps({{"rank": rank, "seed": seed, "url": url}}))
            return url, handle
        """)
    cfg = config.Config(engine=f"{mod}:start", model_path=tiny_model_dir, seed=5)
    eng = rollout.RolloutEngine(cfg, rank=2)
    try:
        call = json.loads((tmp_path / "calls.json").read_text())
        assert call == {"rank": 2, "seed": 2005, "url": eng.url()}  # the user's launcher made this engine
        assert rollout.get(eng.url(), "/get_server_info")["max_running_requests"] == 2
    finally:
        eng.shutdown()
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{call['url']}/health", timeout=2)


def test_weight_transport_by_dotted_path(tiny_model_dir, tmp_path, monkeypatch):
    mod = plug(tmp_path, monkeypatch, "userext_push", f"""
        import json
        import transfermesh

        def push(tensors, engines, bucket_bytes, config_dir, version):
            # the disk path, counted: a user's transport speaks the engines' update endpoints the same way
            n, nbytes = transfermesh._push_disk(tensors, engines, bucket_bytes, config_dir, version)
            open({str(tmp_path / "pushed.json")!r}, "w").write(json.dumps([len(tensors), version]))
            return n, nbytes
        """)
    url, handle = cpu_engine.serve(tiny_model_dir, max_batch=2, max_len=64, seed=0)
    try:
        named = sorted(load_file(f"{tiny_model_dir}/model.safetensors").items())
        stats = transfermesh.push_weights(named, [url], 7, transport=f"{mod}:push", config_dir=tiny_model_dir)
        assert json.loads((tmp_path / "pushed.json").read_text()) == [len(named), "7"]
        assert rollout.get(url, "/get_weight_version")["weight_version"] == "7"
        assert stats["weights/buckets"] == 1 and stats["weights/bytes"] == sum(t.numel() * t.element_size()
                                                                               for _, t in named)
    finally:
        handle.shutdown()
