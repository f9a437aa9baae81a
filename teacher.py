"""Teacher Manager: forward-only teacher workers that score the student's trajectories, token by token.

The controller creates `teacher_tp` `TeacherWorker` actors (one group, its own tensor parallelism), registers
every teacher with `load_teachers`, and each step calls `score(batch)` on all ranks; rank 0 answers with one
target dict per trajectory, which goes by object ref to `TrainerWorker.train_step(..., targets)`:
  * `teacher_logp`        log p_teacher(y_t) of the sampled token (PG-style OPD: A' = A - pg_ratio * KL_t);
  * `teacher_topk_logp`, `teacher_topk_ids` (R, K): the teacher's top-k (`distill_type: topk_kl`), from each TP
    rank's vocabulary shard a chunk of rows at a time (`vocab_topk` / `merge_vocab_topk`: no V-sized gather);
  * `teacher_hidden` {teacher: (R, H)} final hidden states for full-vocabulary divergences: the student side
    applies the teacher's LM head (sent once, `lm_heads`), so no V-sized logits travel;
  * `teacher_mask` (R,): 1 where a teacher scored the token.

Memory: several teachers share one worker group. One model skeleton per architecture is resident; each teacher's
weights wait as a snapshot of this rank's shards (a safetensors file on CPU, read straight into the parameters;
pinned host memory on CUDA), copied in when needed (`_swap_in`). `score` groups the batch by teacher, resident
ones first, so each loads at most once per step. `python bench.py teachers` measures the peak RSS this costs.

Routing (`token_routes`), who teaches which token, first match wins:
  1. `teacher_route: module.fn` — fn(trajectory dict) -> one entry per response token: a teacher name,
     {name: weight, ...} (an ensemble: the target is the weighted mixture of the teachers'
     distributions, algos.mixture_logp), or None (no distillation there). `model_turns` helps to
     route per turn (tool-call turns to one teacher, answers to another);
  2. the trajectory's `metadata["teacher"]`: a sample's own `teacher` field, else its data source's
     `teacher` (a name or a {name: weight} ensemble);
  3. the only teacher, when there is one.

The teachers are built from trainer.py's parts: a `trainer.Parallel` and a forward-only `trainer.Model` per skeleton.

Test: `.venv/bin/python -m pytest -q tests/test_teacher.py`.
Left out: pipeline / expert parallelism for teachers, teachers with a vocabulary other than the
student's (rejected at --check), and prefetching the next teacher while the current one scores.
"""
from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

import algos
import convert
import data
import trainer
import transfermesh

# Fields of an HF config that never change the built model: teachers that differ only in these share a skeleton.
_NOT_ARCH = ("architectures", "torch_dtype", "dtype", "transformers_version", "_name_or_path", "bos_token_id",
             "eos_token_id", "pad_token_id", "use_cache", "name_or_path")


# Rows of logits turned into top-k targets at a time: a chunk's float copy (2**24 floats, 64 MB) is the only V-sized
# tensor the targets add, however many tokens a micro-batch holds.
CHUNK_FLOATS = 2**24


def vocab_topk(logits: torch.Tensor, k: int, offset: int = 0) -> torch.Tensor:
    """One vocabulary shard's part of the top-k targets of n tokens: (n, V_s) logits -> (n, 2k' + 1) float64 rows of
    [k' largest logits, their ids in the whole vocabulary, log-sum-exp of the shard], k' = min(k, V_s); `offset` is
    the shard's first id. float64 carries the ids exactly (any vocabulary below 2**53) in one tensor to all-gather."""
    x = logits.float()                                                    # (n, V_s) the chunk's only V-sized copy
    top = x.topk(min(k, x.size(-1)), -1)                                  # (n, k')
    return torch.cat([top.values.double(), (top.indices + offset).double(),
                      torch.logsumexp(x, -1, keepdim=True).double()], -1)  # (n, 2k' + 1)


def merge_vocab_topk(parts: list[torch.Tensor], k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole vocabulary's (n, k) top-k log-probs and ids from its shards' vocab_topk rows (one shard: no TP).
    log Z = logsumexp over the shards' log Z, and the global top k is among the union of the shards' top k (a shard
    holds at most k of them), so logp_i = logit_i - log Z there: log_softmax's values, without a V-sized tensor."""
    kk = (parts[0].size(-1) - 1) // 2
    vals = torch.cat([p[:, :kk] for p in parts], -1)                      # (n, S k') logits
    ids = torch.cat([p[:, kk:2 * kk] for p in parts], -1)                 # (n, S k')
    lse = torch.logsumexp(torch.stack([p[:, -1] for p in parts]), 0)     # (n,) log Z of the whole vocabulary
    top = vals.topk(k, -1)                                                # (n, k)
    return (top.values - lse[:, None]).float(), ids.gather(-1, top.indices).long()


def teacher_cfg(cfg):
    """The Config a teacher group runs with: the teachers' own tensor parallelism, no PP/EP, no optimizer, and no
    sequence or context parallelism (a forward keeps no activations, and the hidden-state targets read the output
    layer's input, which sequence parallelism would leave split over TP ranks)."""
    t = copy.copy(cfg)
    t.tensor_parallel, t.pipeline_parallel, t.expert_parallel = int(cfg.teacher_tp), 1, 1
    t.context_parallel, t.sequence_parallel = 1, False
    t.router_replay = False  # the routed experts in a trajectory are the student's routing, not a teacher's
    t.trainer_workers = int(cfg.teacher_tp)
    t.micro_batch_size = int(cfg.teacher_micro_batch)
    t.max_tokens_per_micro_batch = 0  # padded rows: the hidden-state targets read the output layer's (T, b, H) input
    return t


def needs_hidden(cfg) -> bool:
    """Full-vocabulary GKD divergences need the teachers' hidden states (top-k and PG need only numbers)."""
    return float(cfg.gkd_ratio) > 0 and cfg.distill_type != "topk_kl"


def arch_key(hf: dict) -> str:
    return data.settings_hash({k: v for k, v in hf.items() if k not in _NOT_ARCH})


def model_turns(traj: dict) -> list[tuple[int, int]]:
    """[start, end) spans of the model's turns in response_ids (runs of loss_mask == 1), for route functions."""
    spans, start = [], None
    for i, m in enumerate(list(traj["loss_mask"]) + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    return spans


def token_routes(traj: dict, names: list[str], route_fn=None) -> torch.Tensor:
    """(R, J) weight of teacher j on response token t; rows sum to 1 on routed model tokens, 0 elsewhere.
    The rules are in the module docstring; unknown names and unroutable trajectories raise ValueError."""
    R, mask = len(traj["response_ids"]), traj["loss_mask"]
    where = f"trajectory group_id={traj.get('group_id')} (source {(traj.get('metadata') or {}).get('source')!r})"
    if route_fn is not None:
        per_token = list(route_fn(traj))
        if len(per_token) != R:
            raise ValueError(f"teacher_route returned {len(per_token)} entries for {R} response tokens of {where}; "
                             "return one (a name, a {name: weight} dict or None) per response token")
    else:
        spec = (traj.get("metadata") or {}).get("teacher")
        if spec is None and len(names) == 1:
            spec = names[0]
        if spec is None:
            raise ValueError(f"{where} has no teacher and there are {len(names)} ({names}); name one on its data "
                             "source (teacher: ...), in the sample (a 'teacher' field), or set teacher_route")
        per_token = [spec] * R
    W = torch.zeros(R, len(names))  # (R, J)
    for t, spec in enumerate(per_token):
        if not mask[t] or spec is None:
            continue
        weights = {spec: 1.0} if isinstance(spec, str) else dict(spec)
        total = sum(float(w) for w in weights.values())
        for name, w in weights.items():
            if name not in names:
                raise ValueError(f"unknown teacher {name!r} for token {t} of {where}; the teachers are {names}")
            if float(w) < 0 or total <= 0:
                raise ValueError(f"ensemble weights {weights} of {where} must be >= 0 and not all 0")
            W[t, names.index(name)] = float(w) / total
    return W


def peak_rss_mb() -> tuple[float, float]:
    """(current, peak) resident set size of this process in MiB (Linux /proc, read by transfermesh; 0 elsewhere)."""
    return transfermesh.rss_bytes() / 2**20, transfermesh.peak_rss_bytes() / 2**20


def read_snapshot_into(path: str, params: dict[str, torch.Tensor]) -> None:
    """Copy a safetensors file's tensors straight into same-named CPU parameters with plain reads.

    Not mmap: a mapping's touched pages count in this process's RSS while it is open (a whole teacher
    at every swap), and get_tensor would allocate a copy; `readinto` fills each parameter's own storage
    and the file's pages stay in the kernel's page cache. Format: 8-byte header length, JSON header
    {name: {dtype, shape, data_offsets}}, then the raw bytes."""
    with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(n))
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            p = params[name]
            start, end = meta["data_offsets"]
            if meta["dtype"] != "F32" or list(meta["shape"]) != list(p.shape) or end - start != p.numel() * 4 \
                    or p.dtype != torch.float32 or not p.is_contiguous():
                raise ValueError(f"snapshot {path}: {name} is {meta['dtype']} {meta['shape']}, the skeleton has "
                                 f"{p.dtype} {tuple(p.shape)}; rebuild the snapshots (delete {path})")
            fh.seek(8 + n + start)
            fh.readinto(memoryview(p.detach().numpy()).cast("B"))


class TeacherWorker:
    """One rank of the teacher group (`ray.remote(TeacherWorker)`); every method is called on all ranks.

    Built from the trainer's parts, no optimizer: a `trainer.Parallel` (its rank in the teacher group's own TP
    layout) and one forward-only `trainer.Model` per architecture, a skeleton whose weights are swapped.
    """

    def __init__(self, cfg, rank: int, world_size: int, master_addr: str, master_port: int):
        self.cfg = teacher_cfg(cfg)
        self.par = trainer.Parallel(self.cfg, rank, world_size, master_addr, master_port)
        # here, not at the top: imported now so base_rss counts Megatron's modules, not the teachers' weights
        from megatron.core.models.gpt import gpt_layer_specs  # noqa: F401
        self.base_rss = peak_rss_mb()[0]  # before any model: what the teachers add is measured against it
        self.names: list[str] = []  # teacher names, in recipe order (columns of token_routes)
        self.skeletons: dict[str, trainer.Model] = {}  # arch key -> resident model of that architecture
        self.arch_of: dict[str, str] = {}  # teacher -> arch key
        self.resident: dict[str, str] = {}  # arch key -> teacher whose weights the skeleton holds now
        self.snapshots: dict[str, object] = {}  # teacher -> safetensors path (CPU) | {name: pinned tensor} (CUDA)
        self.heads: dict[str, torch.Tensor] = {}  # teacher -> full LM head (V, H), hidden-state mode only
        self.swaps = 0  # weight loads into a skeleton since start
        self.calls = 0  # score() calls of this group since start (the drill point `teacher`, trainer.fault)
        self.route_fn = data.import_object(cfg.teacher_route) if cfg.teacher_route else None

    # --- registration and swapping -------------------------------------------------------------------

    def load_teachers(self, paths: dict[str, str], snapshot_dir: str) -> dict:
        """Register teachers {name: HF dir}: build a skeleton per architecture, convert each teacher once
        into this rank's shards and keep them as a snapshot. Returns sizes and the RSS after loading."""
        snap_dir = Path(snapshot_dir)
        snap_dir.mkdir(parents=True, exist_ok=True)
        for name, path in paths.items():
            hf = convert.read_hf_config(path)
            arch = arch_key(hf)
            if arch not in self.skeletons:
                tcfg, kwargs = convert.megatron_config(hf, self.cfg, self.par.on_cpu)
                self.skeletons[arch] = trainer.Model(self.par, tcfg, kwargs, self.cfg.micro_batch_size)
                self.skeletons[arch].gpt.requires_grad_(False).eval()
            self.skeletons[arch].load(convert.hf_to_megatron(convert.load_hf_state(path), hf))
            gpt = self.skeletons[arch].gpt
            if needs_hidden(self.cfg):
                tied = gpt.share_embeddings_and_output_weights
                head_name = "embedding.word_embeddings.weight" if tied else "output_layer.weight"
                w = gpt.embedding.word_embeddings.weight if tied else gpt.output_layer.weight  # (V/tp, H)
                tp_group = self.par.tp_group if self.par.tp_size > 1 else None
                self.heads[name] = convert.gather_full(head_name, w.detach(), tp_group).cpu().clone()  # (V, H)
            local = {n: p.detach() for n, p in gpt.named_parameters()}
            if self.par.on_cpu:  # CPU: a file, read back into the parameters at swap time (page cache, not this heap)
                f = snap_dir / f"{name}.tp{self.par.tp_size}-rank{self.par.tp_rank}.safetensors"
                save_file({n: t.contiguous() for n, t in local.items()}, str(f))
                self.snapshots[name] = str(f)
            else:  # CUDA: pinned host memory, copied back with non_blocking
                self.snapshots[name] = {n: t.to("cpu").pin_memory() for n, t in local.items()}
            self.names.append(name)
            self.arch_of[name] = arch
            self.resident[arch] = name
        rss, peak = peak_rss_mb()
        return {"teachers": list(self.names), "skeletons": len(self.skeletons), "rss_mb": rss, "peak_rss_mb": peak,
                "base_rss_mb": self.base_rss}

    def _swap_in(self, name: str) -> trainer.Model:
        """Make `name` the resident teacher of its skeleton (a copy into the same parameters); its model."""
        arch = self.arch_of[name]
        model = self.skeletons[arch]
        if self.resident.get(arch) != name:
            params = dict(model.gpt.named_parameters())
            snap = self.snapshots[name]
            with torch.no_grad():
                if isinstance(snap, str):
                    read_snapshot_into(snap, params)
                else:
                    for n, t in snap.items():
                        params[n].copy_(t, non_blocking=True)
                    torch.cuda.synchronize()
            self.resident[arch] = name
            self.swaps += 1
        return model

    def lm_heads(self) -> dict[str, torch.Tensor]:
        """{teacher: LM head (V, H)} for the student side of hidden-state targets ({} unless needed)."""
        return dict(self.heads) if self.par.rank == 0 else {}

    def memory(self) -> dict:
        rss, peak = peak_rss_mb()
        return {"rss_mb": rss, "peak_rss_mb": peak, "base_rss_mb": self.base_rss, "swaps": self.swaps}

    # --- scoring ---------------------------------------------------------------------------------------

    def _topk(self, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(n, V/tp) this rank's logits of n tokens -> the whole vocabulary's (n, k) top-k log-probs and ids, a chunk of
        rows at a time (CHUNK_FLOATS): no full-vocabulary log-softmax, and under TP only each shard's top k and
        log-sum-exp travel (vocab_topk, merge_vocab_topk), never the logits."""
        n, vs = logits.shape
        rows = max(1, CHUNK_FLOATS // vs)
        chunks = []  # (values, ids) of each chunk of rows
        for a in range(0, n, rows):
            mine = vocab_topk(logits[a:a + rows], k, self.par.tp_rank * vs)  # (c, 2k' + 1)
            parts = [mine]
            if self.par.tp_size > 1:
                parts = [torch.empty_like(mine) for _ in range(self.par.tp_size)]
                torch.distributed.all_gather(parts, mine, group=self.par.tp_group)
            chunks.append(merge_vocab_topk(parts, k))
        return torch.cat([v for v, _ in chunks]), torch.cat([i for _, i in chunks])

    @torch.no_grad()
    def score(self, batch: list[dict]):
        """(targets, metrics): one target dict per trajectory of `batch` (rank 0; None elsewhere), and
        `teacher/` metrics. Teachers run one after the other, each on the samples it teaches."""
        # Megatron: late; the (few) ensemble tokens' mixtures need whole (n, V) rows of the (n, V/tp) logits
        from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region as whole_vocab
        t0, swaps0 = time.perf_counter(), self.swaps
        J, K = len(self.names), int(self.cfg.teacher_topk)
        routes = [token_routes(traj, self.names, self.route_fn) for traj in batch]  # (R_i, J) each
        hidden = needs_hidden(self.cfg)
        out = [{"teacher_logp": torch.zeros(len(W)), "teacher_mask": (W.sum(1) > 0).float(),  # W (R, J): R tokens
                "teacher_topk_logp": torch.zeros(len(W), K), "teacher_topk_ids": torch.zeros(len(W), K).long(),
                **({"teacher_hidden": {}, "teacher_weight": {}} if hidden else {})} for W in routes]
        mixed: dict[int, dict[str, torch.Tensor]] = {}  # sample -> {teacher: (n_mix, V) logp} for ensemble tokens
        metrics: dict[str, float] = {}
        used = [j for j in range(J) if any(W[:, j].any() for W in routes)]
        used.sort(key=lambda j: self.resident.get(self.arch_of[self.names[j]]) != self.names[j])  # resident first
        for j in used:
            name = self.names[j]
            model = self._swap_in(name)
            idx = [i for i, W in enumerate(routes) if W[:, j].any()]  # the samples this teacher teaches
            tally = [0.0, 0.0]  # k3 of the sampler against this teacher, summed over its tokens; the tokens
            states: list[torch.Tensor] = []  # final (normed) hidden states (T, b, H): the output layer's input

            def take(part, mb, res):  # one micro-batch of `idx`: res logp (b, R), logits (b, R, V/tp)
                logp, logits = res["logp"].float(), res["logits"]  # (b, R), (b, R, V/tp)
                nb, nr = logits.shape[:2]
                topv, topi = (t.view(nb, nr, K) for t in self._topk(logits.flatten(0, 1), K))  # (b, R, K) each
                if hidden:
                    pos = mb["resp_pos"]  # (b, R)
                    hs = states.pop().transpose(0, 1)  # (b, T, H)
                    h = hs.gather(1, pos.unsqueeze(-1).expand(-1, -1, hs.size(-1)))  # (b, R, H)
                for b, k in enumerate(part):
                    i = idx[k]
                    W, r = routes[i], len(batch[i]["response_ids"])
                    w = W[:, j]  # (r,) this teacher's weight per token
                    whole, some = w == 1, (w > 0) & (w < 1)  # (r,) single-teacher / ensemble tokens
                    out[i]["teacher_logp"][whole] = logp[b, :r][whole].cpu()
                    out[i]["teacher_topk_logp"][whole] = topv[b, :r][whole].cpu()
                    out[i]["teacher_topk_ids"][whole] = topi[b, :r][whole].cpu()
                    if some.any():  # routes are the same on every rank: all TP ranks gather these rows, or none
                        rows = (W.sum(1) > 0) & (W.max(1).values < 1)  # (r,) every ensemble token of sample i
                        whole_rows = whole_vocab(logits[b, :r][rows], group=self.par.tp_group).float()  # (n_mix, V)
                        mixed.setdefault(i, {})[name] = torch.log_softmax(whole_rows, -1).cpu()
                    if hidden:
                        out[i]["teacher_hidden"][name] = h[b, :r].cpu()
                        out[i]["teacher_weight"][name] = w.clone()
                    roll = batch[i].get("rollout_logprobs") or []
                    if len(roll) == r:  # how far the student (the sampler) is from this teacher, k3 on its tokens
                        k3 = algos.kl_estimate("k3", torch.tensor(roll, dtype=torch.float), logp[b, :r].cpu())
                        tally[0] += float((k3 * w).sum())
                    tally[1] += float(w.sum())
                return None, None
            hook = model.gpt.output_layer.register_forward_pre_hook(lambda mod, args: states.append(args[0])) \
                if hidden else None
            try:
                model.run([batch[i] for i in idx], take, head="logits")
            finally:
                if hook is not None:
                    hook.remove()
            kl_sum, n_tok = tally
            metrics[f"teacher/{name}/tokens"] = n_tok
            if n_tok:
                metrics[f"teacher/{name}/kl"] = kl_sum / n_tok
            if j != used[-1]:
                trainer.fault("teacher", self.calls, self.par.rank, f"{name} scored, {self.names[used[-1]]} not yet")
        for i, per_teacher in mixed.items():  # ensembles: the target is the weighted mixture of distributions
            W = routes[i]
            rows = (W.sum(1) > 0) & (W.max(1).values < 1)  # (r,)
            names = [n for n in self.names if n in per_teacher]
            logps = torch.stack([per_teacher[n] for n in names])  # (J', n_mix, V)
            weights = torch.stack([W[rows, self.names.index(n)] for n in names])  # (J', n_mix)
            mix = algos.mixture_logp(logps, weights)  # (n_mix, V)
            y = torch.tensor(batch[i]["response_ids"])[rows]  # (n_mix,)
            top = mix.topk(K, -1)
            out[i]["teacher_logp"][rows] = mix.gather(-1, y.unsqueeze(-1)).squeeze(-1)
            out[i]["teacher_topk_logp"][rows], out[i]["teacher_topk_ids"][rows] = top.values, top.indices
        rss, peak, self.calls = *peak_rss_mb(), self.calls + 1
        metrics.update({"teacher/seconds": time.perf_counter() - t0, "teacher/swaps": float(self.swaps - swaps0),
                        "teacher/teachers_used": float(len(used)), "teacher/peak_rss_mb": peak})
        return (out if self.par.rank == 0 else None), metrics
