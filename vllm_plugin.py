"""vLLM's side of `engine: vllm`: a weight-transfer backend that reads weights from shared memory, registered as
vLLM's own plugin. It runs inside vLLM's worker process, in .venv-vllm (scripts/vllm_env.sh), so it imports only
the standard library, torch and vLLM, never LoongSage's modules.

vLLM 0.32's built-in transfer backends (NCCL, CUDA IPC, RDMA) need a GPU. This one is named "loongsage_shm": the
server starts with `--weight-transfer-config {"backend": "loongsage_shm"}` and `--worker-extension-cls
vllm_plugin.WorkerExtension` (vllm_engine.vllm_command), and importing this module to resolve that class registers
the backend with `WeightTransferEngineFactory` before the worker builds its transfer engine (after load_model).
vLLM's four-phase API then drives it: `/init_weight_transfer_engine` (nothing to set up), `/start_weight_update`
(vLLM's layer-by-layer reload starts: the CPU kernels repack linear weights when a layer is loaded, so a plain
`load_weights` into the packed parameters fails half-way), `/update_weights` one bucket at a time, and
`/finish_weight_update` (the reload is finalized, the new weight version set).

A bucket is TransferMesh's shared-memory segment (transfermesh.write_shm_bucket) named by its /dev/shm file, with the
byte offset, dtype and shape of each tensor in it: the worker maps the file and loads from views of it, so the
tensors' bytes are copied once, into the model. vllm_engine.py's front (the SGLang endpoints) builds that request.
Test: tests/test_vllm.py (the vLLM tier). Left out: a GPU transport (vLLM's own NCCL and CUDA IPC backends serve
that), tensor-parallel workers (each would read the same file: only world size 1 is launched).
"""
from __future__ import annotations

import mmap
from dataclasses import dataclass

import torch
from vllm.distributed.weight_transfer.base import (WeightTransferEngine, WeightTransferInitInfo,
                                                   WeightTransferUpdateInfo)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

BACKEND = "loongsage_shm"


@dataclass
class ShmInitInfo(WeightTransferInitInfo):
    """Nothing to rendezvous: the sender is a process on this machine."""


@dataclass
class ShmUpdateInfo(WeightTransferUpdateInfo):
    """One bucket: the /dev/shm file holding it and, per tensor, its name, dtype, shape and byte offset there."""
    shm_file: str
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    offsets: list[int]


class ShmWeightTransferEngine(WeightTransferEngine[ShmInitInfo, ShmUpdateInfo]):
    init_info_cls = ShmInitInfo
    update_info_cls = ShmUpdateInfo
    supports_draft_weight_update = False

    def init_transfer_engine(self, init_info: ShmInitInfo) -> None:
        pass

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload
        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload
        finalize_layerwise_reload(self.model, self.model_config)

    def receive_weights(self, update_info: ShmUpdateInfo) -> None:
        if "/" in update_info.shm_file.strip("/"):
            raise ValueError(f"shm_file names a file directly in /dev/shm; got {update_info.shm_file!r}")
        with open("/dev/shm/" + update_info.shm_file.strip("/"), "rb") as f:
            # a private copy-on-write mapping: torch wants a writable buffer, and nothing here writes to it
            seg = torch.frombuffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY), dtype=torch.uint8)
        weights = []
        for name, dtype_name, shape, off in zip(update_info.names, update_info.dtype_names, update_info.shapes,
                                                update_info.offsets):
            dtype = getattr(torch, dtype_name)
            nbytes = dtype.itemsize * int(torch.Size(shape).numel())
            weights.append((name, seg[off:off + nbytes].view(dtype).reshape(shape)))  # (shape) a view of the file
        self.model.load_weights(weights)

    def shutdown(self) -> None:
        pass


class WorkerExtension:
    """Named by --worker-extension-cls only so that vLLM's worker imports this module (and so registers the
    backend) before it creates its weight-transfer engine; it adds no method to the worker."""


if BACKEND not in WeightTransferEngineFactory._registry:  # a re-import (a second worker in one process) is a no-op
    WeightTransferEngineFactory.register_engine(BACKEND, ShmWeightTransferEngine)
