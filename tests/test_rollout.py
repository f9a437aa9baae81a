"""Tests of rollout.py: RolloutEngine serves the CPU engine and stops it, the SGLang command line passes every
recipe key through, the SGLang child dies with the engine actor's process (the real SGLang launch runs only where
CUDA is), the client helpers raise EngineError carrying the server's own message, and EnginePool's health check
tells a dead or hung engine from one slow answer.

The contract itself (fields, logprobs, weight versions, pause modes, memory tags) is tested against the CPU engine in
tests/test_cpu_engine.py.
"""
import asyncio
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import torch

import config
import cpu_engine
import rollout

ROOT = Path(__file__).resolve().parents[1]


def gen(url, input_ids, **sp):
    return rollout.post(url, "/generate", {"input_ids": input_ids, "sampling_params": sp, "return_logprob": True})


def test_client_helpers_raise_with_the_server_message(tiny_model_dir):
    url, handle = cpu_engine.serve(tiny_model_dir, max_batch=2, max_len=64, seed=0)
    try:
        with pytest.raises(rollout.EngineError, match=r"HTTP 400: .*input_ids"):
            rollout.post(url, "/generate", {"sampling_params": {}})
        rollout.post(url, "/begin_weight_update", {"selector": "all"})  # updates run inside a session (SGLang 0.5.23)
        try:
            with pytest.raises(rollout.EngineError, match="init_weights_update_group"):
                rollout.post(url, "/update_weights_from_distributed", {"names": [], "dtypes": [], "shapes": [],
                                                                       "group_name": "nope"})
        finally:
            rollout.post(url, "/end_weight_update", {})
        assert rollout.get(url, "/get_model_info")["is_generation"] is True
        assert httpx.get(f"{url}/health_generate", timeout=30).status_code == 200
    finally:
        handle.shutdown()


def _cfg(model_path, tmp_path, **over):
    base = dict(model_path=model_path, engine="cpu", engine_max_batch=4, max_prompt_len=64, max_new_tokens=16,
                max_context_len=128, seed=0, dtype="float32", device="cpu", sglang={}, gpus_per_engine=1, engine_threads=0,
                output_dir=str(tmp_path))
    return config.Config(**{**base, **over})  # a real Config: it is the only source of defaults


def test_rollout_engine_serves_the_cpu_engine(tiny_model_dir, tmp_path):
    """The CPU engine gets the SGLang flags sglang_options gives an SGLang server: by default deterministic
    inference, so a trajectory's sampling_seed decides its tokens (SGLang ignores it otherwise), and the prefix cache;
    a recipe's null turns the first off."""
    eng = rollout.RolloutEngine(_cfg(tiny_model_dir, tmp_path), rank=1)
    url = eng.url()
    try:
        info = rollout.get(url, "/server_info")
        assert info["context_len"] == 128 and info["max_running_requests"] == 4 and info["random_seed"] == 1000
        assert info["enable_deterministic_inference"] is True and info["disable_radix_cache"] is False
        assert len(gen(url, [1, 2, 3], max_new_tokens=4, ignore_eos=True)["output_ids"]) == 4
        seeded = [gen(url, [1, 2, 3], max_new_tokens=12, ignore_eos=True, sampling_seed=7)["output_ids"]
                  for _ in range(2)]
        assert seeded[0] == seeded[1] != gen(url, [1, 2, 3], max_new_tokens=12, ignore_eos=True,
                                             sampling_seed=8)["output_ids"]
    finally:
        eng.shutdown()
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{url}/health", timeout=2)
    eng = rollout.RolloutEngine(_cfg(tiny_model_dir, tmp_path, sglang={"enable_deterministic_inference": None,
                                                                       "disable_radix_cache": True}), rank=1)
    try:
        info = rollout.get(eng.url(), "/server_info")
        assert info["enable_deterministic_inference"] is False and info["disable_radix_cache"] is True
    finally:
        eng.shutdown()


def test_sglang_command_passes_every_key_through(tmp_path):
    cfg = _cfg("/models/qwen", tmp_path, engine="sglang", gpus_per_engine=2,
               sglang={"mem_fraction_static": 0.7, "enable_metrics": True, "disable_radix_cache": False,
                       "cuda_graph_bs": [1, 2, 4], "weight_version": "9"})
    cmd = rollout.sglang_command(cfg, "127.0.0.1", 30001, seed=5)
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    line = " ".join(cmd[3:])
    for part in ("--model-path /models/qwen", "--host 127.0.0.1", "--port 30001", "--mem-fraction-static 0.7",
                 "--enable-metrics", "--cuda-graph-bs 1 2 4", "--tp-size 2", "--random-seed 5", "--weight-version 9"):
        assert part in line
    assert "disable-radix-cache" not in line
    cfg.sglang = {"weight_version": None}  # null drops one of LoongSage's default flags
    assert "--weight-version" not in rollout.sglang_command(cfg, "127.0.0.1", 30001, seed=5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sglang_serves_the_trainers_dtype_and_honours_seeds(tmp_path, dtype):
    """--dtype follows cfg.dtype (SGLang's "auto" serves an fp32 checkpoint in float16, against the trainer's fp32
    or bf16), and --enable-deterministic-inference is on, the one mode in which SGLang honours the sampling_seed every
    trajectory carries; the recipe's sglang dict overrides either, and null drops it."""
    cfg = _cfg("/models/qwen", tmp_path, engine="sglang", dtype=dtype)
    cmd = rollout.sglang_command(cfg, "127.0.0.1", 30001, seed=5)
    assert cmd[cmd.index("--dtype") + 1] == dtype and "--enable-deterministic-inference" in cmd
    cfg.sglang = {"dtype": "float16", "enable_deterministic_inference": None}
    cmd = rollout.sglang_command(cfg, "127.0.0.1", 30001, seed=5)
    assert cmd[cmd.index("--dtype") + 1] == "float16" and "--enable-deterministic-inference" not in cmd


def test_gpu_extra_pins_the_sglang_the_code_speaks_and_the_torch_it_requires():
    """rollout.py and transfermesh.py speak SGLang 0.5.23's contract (/begin_weight_update is new in it), and
    sglang 0.5.23's wheel requires torch==2.14.1: the gpu extra pins both, and bootstrap.sh's GPU branch installs
    that same torch first (a torch of its own choosing would be replaced by pip, or conflict)."""
    import tomllib
    gpu = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]
    assert "sglang==0.5.23" in gpu and "torch==2.14.1" in gpu
    assert '"${TORCH_SPEC:-torch==2.14.1}"' in (ROOT / "bootstrap.sh").read_text()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="SGLang needs CUDA")
def test_rollout_engine_launches_sglang(tiny_model_dir, tmp_path):
    import sglang  # noqa: F401 - where CUDA is, bootstrap.sh installed it: missing is a broken install, not a skip
    eng = rollout.RolloutEngine(_cfg(tiny_model_dir, tmp_path, engine="sglang", gpus_per_engine=1,
                                     sglang={"mem_fraction_static": 0.2}), rank=0)
    try:
        out = gen(eng.url(), [1, 2, 3], temperature=0, max_new_tokens=4, ignore_eos=True)
        assert len(out["output_ids"]) == 4 and len(out["meta_info"]["output_token_logprobs"]) == 4
        assert out["meta_info"]["weight_version"] == "0"
    finally:
        eng.shutdown()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_sglang_child_dies_with_the_engine_process():
    """A server started with _die_with_parent ends when the process that started it is killed (SIGKILL
    included), so a killed engine actor leaves no server holding GPUs. `sleep` stands in for the server."""
    code = ("import subprocess, sys; sys.path.insert(0, %r); import rollout; "
            "p = subprocess.Popen(['sleep', '60'], preexec_fn=rollout._die_with_parent, start_new_session=True); "
            "print(p.pid, flush=True); import os, signal; os.kill(os.getpid(), signal.SIGKILL)") % str(ROOT)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    pid = int(out.stdout.strip())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            state = open(f"/proc/{pid}/status").read().split("State:")[1].split()[0]
        except FileNotFoundError:
            state = "gone"
        if state in ("Z", "X", "gone"):  # exited (a zombie is dead, merely not yet reaped)
            break
        time.sleep(0.1)
    assert state in ("Z", "X", "gone"), state


def _probe_server(hold: threading.Event, times: int | None) -> tuple[str, ThreadingHTTPServer]:
    """A real HTTP server whose GET /server_info answers 200, except that its first `times` probes (all of them if
    None) wait for `hold` first."""
    seen = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append(self.path)
            if times is None or len(seen) <= times:
                hold.wait()
            try:
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")
            except OSError:  # the prober gave up on this answer and closed the connection
                pass

        def log_message(self, *a):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}", server


def test_engine_pool_check_tolerates_one_slow_probe_not_two_nor_a_refused_one():
    """EnginePool.check: an engine that refuses the probe (nothing listens) leaves routing at the first check; one
    silent past health_timeout_s leaves at the second check in a row; one that missed a single probe and answers the
    next stays in routing (an engine on a loaded machine: a vLLM run at load ~17 lost its only engine to one
    /server_info slower than 10 s). The silent answers are held on an event, not slept, so no speed is assumed."""
    slow_hold, hung_hold = threading.Event(), threading.Event()
    (slow, s1), (hung, s2) = _probe_server(slow_hold, 1), _probe_server(hung_hold, None)
    refused = "http://127.0.0.1:9"  # the discard port: nothing listens

    async def go():
        pool = rollout.EnginePool([refused, slow, hung], health_timeout_s=3.0, check_every_s=0)
        first = await pool.check()
        slow_hold.set()  # the slow engine answers from now on; the hung one never does
        second, third = await pool.check(), await pool.check()
        healthy = pool.healthy()
        await pool.close()
        return first, second, third, healthy

    try:
        first, second, third, healthy = asyncio.run(go())
    finally:
        hung_hold.set()
        s1.shutdown(), s2.shutdown()
    assert first == [refused]
    assert second == third == [refused, hung]
    assert healthy == [slow]
