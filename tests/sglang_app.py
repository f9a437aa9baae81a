"""SGLang 0.5.23's own HTTP server on CPU, for the conformance tier (tests/test_sglang_conformance.py): its FastAPI
`app`, its TokenizerManager's control methods (sessions, pause/continue, locks, weight versions), the msgpack IPC
encoding between tokenizer manager and scheduler, the scheduler's weight-update manager (begin/end session rules,
memory tags) and the model runner's WeightUpdater (payload deserialization, FlattenedTensorBucket, SGLang's own
process-group rendezvous) and WeightChecker, all SGLang's code. Faked, because they need CUDA: the scheduler
process's socket (requests are decoded and handled on one thread here, as the scheduler's loop would; its flush
wrapper and internal-state readback answer /flush_cache and /server_info, and an exception in a handler ends the
server as SGLang's scheduler ends it, so a wrong request fails a test instead of hanging it) and the model (an
nn.Module holding the HF checkpoint's tensors by HF name, whose `load_weights` copies by name and refuses an unknown
name, as SGLang's model classes do).

Run: `.venv-sglang/bin/python tests/sglang_app.py --model-path DIR --port P` (the tier starts it as a process: a
broadcast group is one rank per process, as in a real run). Besides SGLang's routes it serves `GET
/conformance/loaded`: what the fake model received (name, dtype, shape, sha256 of the bytes, per load) and the
pause modes the scheduler got; and `POST /conformance/compile {"seconds": s}`: a grammar compiling for s seconds.
Left out: generation (`/generate` needs the scheduler and the model; its request bodies are validated against
SGLang's structs in the tier instead), multi-rank TP.
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import hashlib
import os
import pickle
import sys
import threading
import time
import traceback
import types

import torch
import torch.distributed as dist


class FakeModel(torch.nn.Module):
    """The checkpoint's tensors as parameters under their HF names; `load_weights` is what SGLang's runners call."""

    def __init__(self, model_dir: str):
        super().__init__()
        from safetensors.torch import load_file
        self.names = []
        for name, t in sorted(load_file(f"{model_dir}/model.safetensors").items()):
            self.register_parameter(name.replace(".", "__"), torch.nn.Parameter(t, requires_grad=False))
            self.names.append(name)
        self.loads: list[list] = []  # one entry per load_weights call: [[name, dtype, shape, sha256], ...]

    def load_weights(self, weights):
        params = {n: getattr(self, n.replace(".", "__")) for n in self.names}
        got = []
        for name, t in weights:
            if name not in params:  # SGLang's model classes raise KeyError on a name they do not map
                raise KeyError(f"{name} is not a parameter of the model")
            with torch.no_grad():
                params[name].copy_(t)
            data = t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
            got.append([name, str(t.dtype).removeprefix("torch."), list(t.shape), hashlib.sha256(data).hexdigest()])
        self.loads.append(got)


def build_app(model_dir: str):
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.entrypoints import http_server
    from sglang.srt.managers import io_struct as io
    from sglang.srt.managers.scheduler_components.flush_wrapper import SchedulerFlushWrapper
    from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager
    from sglang.srt.managers.tokenizer_manager import TokenizerManager
    from sglang.srt.managers.tp_worker import TpModelWorker
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater
    from sglang.srt.runtime_context import get_context, get_parallel
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.utils.aio_rwlock import RWLock
    from sglang.srt.utils.msgspec_utils import msgspec_to_builtins
    from sglang.srt.utils.weight_checker import WeightChecker
    from sglang.utils import TypeBasedDispatcher

    server_args = ServerArgs(model_path=model_dir, device="cpu")
    get_context().set_server_args(server_args)
    # A world of one: SGLang asserts a default group before it builds a weight-update group, and barriers on its
    # TP group (of one here) around updates
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    get_parallel().override_permanently(tp_rank=0, dp_rank=None, pp_rank=0,
                                        tp_group=types.SimpleNamespace(cpu_group=dist.group.WORLD))

    model_config = ModelConfig.from_server_args(server_args)
    model = FakeModel(model_dir)
    runner = types.SimpleNamespace(model=model)
    runner.weight_updater = WeightUpdater(
        tp_rank=0, device="cpu", gpu_id=0, model_config=model_config, custom_weight_loaders={}, get_model=lambda: model,
        update_model_fields=lambda *a, **k: None, recapture_cuda_graph=lambda: None, get_model_runner=lambda: runner)
    runner.check_weights = WeightChecker(get_model=lambda: model).handle
    worker = types.SimpleNamespace(model_runner=runner, weight_update_runners=lambda: [("target", runner)])
    for name in ("deserialize_own_rank", "init_weights_update_group", "destroy_weights_update_group"):
        setattr(worker, name, getattr(TpModelWorker, name).__get__(worker))

    class MemorySaver:  # torch_memory_saver needs CUDA: release/resume only record their tags here
        def pause(self, tag):
            pass

        def resume(self, tag):
            pass

    scheduler = types.SimpleNamespace(_engine_paused=False, disaggregation_mode=None, pauses=[])
    scheduler.record_weight_version_change = lambda new_version: new_version is not None and get_context().override(
        "scheduler.weight_version", weight_version=new_version)
    updater = SchedulerWeightUpdaterManager(tp_worker=worker, draft_worker=None, memory_saver_adapter=MemorySaver(),
                                            flush_cache=lambda **kw: True, is_fully_idle=lambda **kw: True,
                                            scheduler=scheduler)

    def pause(req):
        scheduler._engine_paused = True
        scheduler.pauses.append(req.mode)

    def cont(req):
        scheduler._engine_paused = False

    # nothing runs here, so the scheduler is idle but for a grammar said to compile (POST /conformance/compile):
    # SGLang's scheduler counts its grammar queue as busy, paused or not, and flushes only when idle
    compiling = {"until": 0.0}
    idle = lambda: time.monotonic() >= compiling["until"]  # noqa: E731
    flusher = SchedulerFlushWrapper(flush_cache=idle, is_fully_idle=idle, send_output=lambda out, req: None)
    handle = TypeBasedDispatcher([
        (io.FlushCacheReqInput, flusher.handle),
        # the scheduler's readback of its resolved server args (the per-step contributions need its loop: left out)
        (io.GetInternalStateReq, lambda r: io.GetInternalStateReqOutput(
            internal_state=msgspec_to_builtins(get_context().resolved_server_args_dict()))),
        (io.BeginWeightUpdateReqInput, updater.begin_weight_update),
        (io.EndWeightUpdateReqInput, updater.end_weight_update),
        (io.UpdateWeightsFromTensorReqInput, updater.update_weights_from_tensor),
        (io.InitWeightsUpdateGroupReqInput, updater.init_weights_update_group),
        (io.DestroyWeightsUpdateGroupReqInput, updater.destroy_weights_update_group),
        (io.UpdateWeightsFromDistributedReqInput, updater.update_weights_from_distributed),
        (io.UpdateWeightFromDiskReqInput, updater.update_weights_from_disk),
        (io.ReleaseMemoryOccupationReqInput, updater.release_memory_occupation),
        (io.ResumeMemoryOccupationReqInput, updater.resume_memory_occupation),
        (io.CheckWeightsReqInput, updater.check_weights),
        (io.UpdateWeightVersionReqInput, lambda r: (scheduler.record_weight_version_change(r.new_version),
                                                    io.UpdateWeightVersionReqOutput())[1]),
        (io.PauseGenerationReqInput, pause),
        (io.ContinueGenerationReqInput, cont),
        (io.AbortReq, lambda r: None),
    ])

    # The tokenizer manager: SGLang's class, its state set as its __init__ would for one DP rank, without the
    # tokenizer, the detokenizer and the zmq sockets.
    tm = TokenizerManager.__new__(TokenizerManager)
    tm.tokenizer_ipc_name, tm.mm_processor, tm.enable_metrics, tm.rid_to_state = None, None, False, {}
    tm.model_update_lock, tm.is_pause, tm.is_pause_cond = RWLock(), False, asyncio.Condition()
    tm.initial_weights_loaded, tm.server_args, tm.model_config = True, server_args, model_config
    tm.model_path = tm.served_model_name = model_dir  # what /model_info reports, with the served weight_version
    tm.is_generation, tm.startup_time = True, time.time()
    tm.auto_create_handle_loop, tm.elastic_worker_count = (lambda: None), 1
    tm.init_request_dispatcher()
    loop_box = {}
    scheduler_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="scheduler")

    class Socket:
        """The scheduler's end of the IPC socket: each message is decoded as the scheduler decodes it and handled on
        the scheduler thread; an answer goes back through the tokenizer manager's own result dispatcher."""

        def send(self, data, flags=0):  # SGLang's msgpack IPC encoding
            return self._handle(io.msgpack_decode(data))

        def send_pyobj(self, obj, flags=0, protocol=pickle.HIGHEST_PROTOCOL):  # its pickle IPC (the default)
            return self._handle(pickle.loads(pickle.dumps(obj, protocol=protocol)))

        def _handle(self, obj):
            loop = loop_box.setdefault("loop", asyncio.get_running_loop())

            def run():
                try:
                    out = handle(obj)
                except Exception:  # noqa: BLE001 - as SGLang's scheduler: it logs, SIGQUITs the launcher, which
                    traceback.print_exc()  # kills the server's process tree; a client sees the connection drop
                    print("Scheduler hit an exception: the server ends", file=sys.stderr, flush=True)
                    os._exit(1)
                if out is not None:
                    loop.call_soon_threadsafe(tm._result_dispatcher, out)
            scheduler_thread.submit(run)
            return _Sent()

    class _Sent:  # awaitable for async_sock_send, ignored by sock_send
        def __await__(self):
            return iter(())

    tm.send_to_scheduler = Socket()
    http_server.set_global_state(http_server._GlobalState(tokenizer_manager=tm, template_manager=None,
                                                          scheduler_info={}))
    app = http_server.app

    @app.get("/conformance/loaded")
    async def loaded():
        return {"loads": model.loads, "pauses": scheduler.pauses}

    @app.post("/conformance/compile")
    async def compile_for(body: dict):
        compiling["until"] = time.monotonic() + float(body["seconds"])
        return {}

    return app


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args()
    import uvicorn
    app = build_app(args.model_path)
    uvicorn.run(app, host="127.0.0.1", port=args.port, lifespan="off", log_level="warning")
