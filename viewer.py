"""Trajectory viewer: one static, self-contained HTML page for the rollouts a run dumped.

    python viewer.py RUN_DIR                      # a run's output_dir (config.yaml names its dump_rollouts dir)
    python viewer.py DUMP_DIR                     # the step_XXXXX.jsonl files that dump_rollouts=DIR wrote
    python viewer.py DUMP_DIR/step_00003.jsonl    # one step (any jsonl of trajectory dicts works)
      -o page.html          where to write it (default: trajectories.html in the dir, or FILE.html)
      --tokenizer DIR|none  an HF directory (or a run dir) to decode tokens with; `none` shows token ids
      --steps 0,3-5         only these steps
      --max-tokens N        token budget of the page (default 1,000,000; split equally between steps)

The page shows every trajectory's prompt and turns token by token: model turns (the engine's tokens) apart
from the tool results and template tokens between them, and each segment of a compacted trajectory. Three
colour modes: `mask` (trained / generated but masked out / tool or template / prompt), `logprob` (the
engine's logprob of each model token, in buckets) and `version` (the weight version that sampled it).
Hovering a token shows its text, id, logprob and version. Each trajectory's header gives its reward, status,
per-turn rewards and error; filters select a step, statuses and a reward range. The URL's hash holds that
state (`page.html#mode=logprob&step=3&status=ok&rmin=0.5`), so a view can be shared or opened as is.

What the page shows is what the trainer trains (trainer.segment_rows): earlier segments as dumped in
`segments`, the last one from the trajectory's top-level fields (where a failed trajectory's loss mask is all
zero and stale tokens were masked by `lag_policy: mask`).

Decoding needs the run's tokenizer: `--tokenizer`, else the config.yaml of the run (the run dir, or beside
the dump dir): `model_path` is an HF directory, or `tiny`, whose tokenizer data.py rebuilds deterministically.
Without one the page shows token ids. If the tokenizer does not decode the trajectories' prompts to their
`prompt_text`, the page says so at the top.

Model output is data, never markup: the trajectories travel as JSON inside a <script type="application/json">
element with '<', '>' and '&' escaped, and the page builds every element with textContent, so no string
from a rollout file can open a tag or run a script.

Tested by tests/test_viewer.py: the page of a real tiny run opened in headless Chromium (Debian's `chromium`),
with pixel counts on its screenshot, the DOM's counts against the dump, no console message, and escaping.
Left out: comparing two runs, a live view of a running job (rerun the command), and decoding across token
boundaries (a character split over two byte-level tokens shows as U+FFFD in each).
"""
from __future__ import annotations

import argparse
import html
import json
import math
import re
import tempfile
from pathlib import Path

import yaml

import data

STEP_FILE = re.compile(r"^step_(\d+)\.jsonl$")  # what loongsage.dump writes: dump_rollouts/step_00003.jsonl
MAX_TOKENS = 1_000_000  # ~14 MB of HTML (2M tokens, 27 MB, still opened in Chromium here; 50 cards render at a time)
TRAJ_KEYS = ("prompt_ids", "response_ids", "loss_mask", "rollout_logprobs", "weight_versions")


# ----------------------------------------------------------------------------------------------
# finding the rollouts and the run they came from


def read_config(path: Path) -> dict:
    cfg = yaml.safe_load(path.read_text())
    if not isinstance(cfg, dict):
        raise ValueError(f"{path} is not a LoongSage config.yaml (a mapping of keys); it holds {type(cfg).__name__}")
    return cfg


def find_config(dump_dir: Path) -> dict | None:
    """The config.yaml of the run that wrote `dump_dir`: in it, or in its parent (dump_rollouts=RUN_DIR/rollouts)."""
    for d in (dump_dir, dump_dir.parent):
        if (d / "config.yaml").is_file():
            return read_config(d / "config.yaml")
    return None


def dump_dir_of(run_dir: Path, cfg: dict) -> Path:
    """The dump_rollouts dir of a run dir. A relative path in config.yaml is relative to where the run was
    launched; output_dir (relative to the same place) says where that was."""
    d = Path(cfg["dump_rollouts"])
    if d.is_absolute():
        return d
    tried = []
    out, here = Path(cfg.get("output_dir") or "."), run_dir.resolve()
    if not out.is_absolute() and out.parts and here.parts[-len(out.parts):] == out.parts:
        tried.append(Path(*here.parts[:-len(out.parts)]) / d)
    tried.append(Path.cwd() / d)
    for p in tried:
        if p.is_dir():
            return p
    raise FileNotFoundError(f"run dir {run_dir} dumped its rollouts to dump_rollouts={str(d)!r}, which is not at "
                            f"{' nor '.join(str(p) for p in tried)}; pass that directory to viewer.py instead")


def rollout_files(path: Path) -> tuple[list[tuple[int, Path]], dict | None]:
    """The rollout files `path` names, as (step, file) in step order, and the run's config if one is found."""
    if path.is_file():
        m = STEP_FILE.match(path.name)
        return [(int(m.group(1)) if m else 0, path)], find_config(path.parent)
    if not path.is_dir():
        raise FileNotFoundError(f"{path} does not exist; give a run dir, a dump_rollouts dir or a step_XXXXX.jsonl")
    cfg, dump = find_config(path), path
    if (path / "config.yaml").is_file() and not any(path.glob("step_*.jsonl")):  # a run dir
        if not cfg.get("dump_rollouts"):
            raise ValueError(f"run dir {path} has no rollouts: its config.yaml has "
                             f"dump_rollouts={cfg.get('dump_rollouts')!r}; "
                             "run with dump_rollouts=DIR (rollout_only=true to only generate) and view DIR")
        dump = dump_dir_of(path, cfg)
    files = sorted((int(m.group(1)), p) for p in dump.iterdir() if (m := STEP_FILE.match(p.name)))
    if not files:
        raise FileNotFoundError(f"no step_XXXXX.jsonl in {dump}: not a dump_rollouts dir; give one, or a .jsonl file")
    return files, cfg


def parse_steps(spec: str) -> set[int]:
    """'0,3-5' -> {0, 3, 4, 5}."""
    steps = set()
    for part in filter(None, (p.strip() for p in spec.split(","))):
        a, _, b = part.partition("-")
        if not a.isdigit() or (b and not b.isdigit()):
            raise ValueError(f"--steps {spec!r}: {part!r} is not a step or a range; write e.g. 0,3-5")
        steps.update(range(int(a), int(b or a) + 1))
    return steps


# ----------------------------------------------------------------------------------------------
# reading trajectories into the page's compact form


def _num(x, digits: int | None = None):
    """A JSON-safe number: NaN / inf become null (the page shows them as such)."""
    if x is None or not math.isfinite(float(x)):
        return None
    return round(float(x), digits) if digits is not None else float(x)


def _segment(seg: dict, limit: int) -> dict:
    """One context segment: prompt ids, then per response token its id, loss mask, logprob and version.
    At most `limit` tokens are kept (prompt first)."""
    p = seg["prompt_ids"][:limit]
    r = max(0, limit - len(p))
    return {"p": p, "ids": seg["response_ids"][:r], "m": [int(x) for x in seg["loss_mask"][:r]],
            "lp": [_num(x, 4) for x in seg["rollout_logprobs"][:r]],
            "v": [int(x) for x in seg["weight_versions"][:r]]}


def compact(t: dict, step: int, line: int, limit: int, where: str) -> tuple[dict, int]:
    """A trajectory as the page holds it, at most `limit` tokens; returns it and its full token count. Earlier
    segments come from `segments`, the last from the top-level fields: what trainer.segment_rows trains."""
    missing = [k for k in TRAJ_KEYS if k not in t]
    if missing:
        raise ValueError(f"{where} is not a LoongSage trajectory: it lacks {missing} (keys seen: {sorted(t)[:12]}); "
                         "view files written by dump_rollouts")
    n = len(t["response_ids"])
    bad = [k for k in TRAJ_KEYS[2:] if len(t[k]) != n]
    if bad:
        raise ValueError(f"{where}: {bad} do not have one entry per response token ({n}): "
                         f"{[len(t[k]) for k in bad]}; the file is damaged")
    segs = [*(t.get("segments") or [])[:-1], t]
    full = sum(len(s["prompt_ids"]) + len(s["response_ids"]) for s in segs)
    out, left = [], limit
    for s in segs:
        if left > 0:
            out.append(_segment(s, left))
            left -= len(out[-1]["p"]) + len(out[-1]["ids"])
    meta = t.get("metadata") or {}
    return {"s": step, "i": line, "g": t.get("group_id"), "k": t.get("sample_index"), "r": _num(t.get("reward")),
            "st": str(t.get("status", "?")), "tr": [_num(x) for x in t.get("turn_rewards") or []],
            "e": str(meta.get("error") or ""), "nseg": len(segs), "cut": full - limit if full > limit else 0,
            "segs": out}, full


def read_trajectories(files: list[tuple[int, Path]], max_tokens: int) -> tuple[list[dict], int, dict]:
    """Every step keeps its first trajectories (file order) while they fit in an equal share of `max_tokens`;
    the first one of a step always shows, cut to the share if it is longer. Returns the kept trajectories,
    how many the files hold, and one trajectory's (prompt ids, prompt_text) to check the tokenizer on."""
    share = max(1, max_tokens // len(files))
    kept, total, probe = [], 0, {}
    for step, f in files:
        used = 0
        with open(f) as fh:
            for line_no, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                total += 1
                if used >= share:
                    continue  # counted, not parsed: a huge file costs one pass
                where = f"{f}:{line_no}"
                try:
                    t = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{where} is not JSON ({e}); the file is damaged or not a rollout dump") from e
                if not isinstance(t, dict):
                    raise ValueError(f"{where} holds a {type(t).__name__}, not a trajectory dict")
                c, n = compact(t, step, line_no, share - used, where)
                if used and used + n > share:
                    used = share  # the step's share is spent: the rest of the file is only counted
                    continue
                kept.append(c)
                used += n
                if not probe and t.get("prompt_text"):
                    probe = {"ids": t["prompt_ids"], "text": t["prompt_text"]}
    return kept, total, probe


# ----------------------------------------------------------------------------------------------
# the tokenizer: token id -> text


def load_tokenizer(spec: str | None, cfg: dict | None) -> tuple[object | None, str]:
    """(tokenizer or None, what the page says about it). `spec` (--tokenizer) must work if given; the run's
    own tokenizer falls back to token ids with the reason."""
    if spec == "none":
        return None, "token ids shown (--tokenizer none)"
    if spec and (Path(spec) / "config.yaml").is_file() and not (Path(spec) / "tokenizer_config.json").is_file():
        spec, cfg = None, read_config(Path(spec) / "config.yaml")  # a run dir: its model's tokenizer
    if spec:
        try:
            return data.load_tokenizer(spec), f"tokens decoded with the tokenizer of {spec}"
        except Exception as e:
            raise ValueError(f"--tokenizer {spec!r} could not be loaded ({type(e).__name__}: {e}); give an HF "
                             "model directory (tokenizer.json / tokenizer_config.json), a run dir, or none") from e
    model = (cfg or {}).get("model_path")
    if not model:
        return None, ("token ids shown: no config.yaml of the run was found beside the rollouts to name its model; "
                      "pass --tokenizer HF_DIR")
    try:
        if model == "tiny":  # the run built it with data.py from these settings; building it again is exact
            vocab = {**data.TINY_DEFAULTS, **(cfg.get("tiny_model") or {})}["tokenizer_vocab"]
            with tempfile.TemporaryDirectory(prefix="loongsage-viewer-") as tmp:
                data.build_tiny_tokenizer(tmp, vocab)
                return data.load_tokenizer(tmp), f"tokens decoded with the tiny tokenizer (vocab {vocab}, rebuilt)"
        return data.load_tokenizer(model), f"tokens decoded with the tokenizer of {model}"
    except Exception as e:
        return None, (f"token ids shown: the run's tokenizer ({model}) could not be loaded ({type(e).__name__}: "
                      f"{e}); pass --tokenizer HF_DIR")


def token_texts(tok, trajs: list[dict]) -> dict[int, str]:
    """The text of every token id the page uses, each decoded on its own (special tokens kept)."""
    ids = sorted({i for t in trajs for s in t["segs"] for i in (*s["p"], *s["ids"])})
    return {i: tok.decode([i], skip_special_tokens=False) for i in ids}


# ----------------------------------------------------------------------------------------------
# the page: static markup, styles and script; the data as escaped JSON


def _script_json(obj) -> str:
    """JSON that is safe inside a <script> element: with '<', '>' and '&' escaped no string can close the
    element or open a comment, and JSON.parse reads the escapes back as the same characters."""
    text = json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


STYLE = """
body { font: 14px system-ui, sans-serif; margin: 0; background: #fff; color: #222; }
header { position: sticky; top: 0; background: #f6f6f6; border-bottom: 1px solid #ccc; padding: 8px 12px; z-index: 1; }
header h1 { font-size: 15px; margin: 0 0 6px 0; }
header label { margin-right: 12px; }
header input[type=number] { width: 6em; }
#notes div { background: #fff3cd; border: 1px solid #e0c070; padding: 3px 6px; margin: 4px 0; }
#legend span.tok { margin-right: 8px; }
main { padding: 8px 12px; }
.card { border: 1px solid #ccc; border-radius: 4px; margin: 0 0 10px 0; padding: 6px 8px; }
.head { font-weight: 600; margin-bottom: 4px; }
.err { color: #a00; font-family: monospace; white-space: pre-wrap; margin-bottom: 4px; }
.seg { border-left: 3px solid #999; padding-left: 6px; margin: 4px 0; }
.block { display: flex; margin: 2px 0; }
.toks { font: 13px/1.7 monospace; white-space: pre-wrap; word-break: break-all; }
.lab { flex: 0 0 8.5em; font: 11px/2 system-ui, sans-serif; color: #555; }
.tok { border-radius: 2px; padding: 1px 0; margin-right: 1px; }
/* mask: trained / model token masked out (failed, stale) / tool or template token / prompt */
body[data-mode=mask] .t { background: #7fd67f; }
body[data-mode=mask] .u { background: #f4c26b; }
body[data-mode=mask] .x { background: #cfe0f7; }
.p { background: #e4e4e4; }
body:not([data-mode=mask]) .x { background: #e4e4e4; }
/* logprob of model tokens: buckets from sure (lp0) to unlikely (lp6); lpn: no finite logprob */
body[data-mode=logprob] .lp0 { background: #fff7bc; } body[data-mode=logprob] .lp1 { background: #fee391; }
body[data-mode=logprob] .lp2 { background: #fec44f; } body[data-mode=logprob] .lp3 { background: #fe9929; }
body[data-mode=logprob] .lp4 { background: #ec7014; } body[data-mode=logprob] .lp5 { background: #cc4c02; color: #fff; }
body[data-mode=logprob] .lp6 { background: #8c2d04; color: #fff; } body[data-mode=logprob] .lpn { background: #999; }
/* weight version of model tokens: up to 8 colours (one per version, or version ranges) */
body[data-mode=version] .v0 { background: #8dd3c7; } body[data-mode=version] .v1 { background: #bebada; }
body[data-mode=version] .v2 { background: #fb8072; } body[data-mode=version] .v3 { background: #80b1d3; }
body[data-mode=version] .v4 { background: #fdb462; } body[data-mode=version] .v5 { background: #b3de69; }
body[data-mode=version] .v6 { background: #fccde5; } body[data-mode=version] .v7 { background: #bc80bd; }
"""

SCRIPT = r"""
"use strict";
// Everything from the rollout file is data: elements are built with textContent only, never innerHTML.
const D = JSON.parse(document.getElementById("viewer-data").textContent);
const PAGE = 50;  // cards rendered at a time ("show more" adds the next ones)
const LP_EDGES = [-0.05, -0.25, -0.5, -1, -2, -4];  // logprob bucket k: below k of these edges
let errors = 0;
window.addEventListener("error", () => { errors += 1; document.body.dataset.errors = errors; });

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}
function fmt(x, d) { return x === null || x === undefined ? "null" : (+x).toFixed(d); }

// weight versions: one colour each when there are at most 8, else 8 equal ranges
const VERSIONS = [...new Set(D.trajs.flatMap(t => t.segs.flatMap(s => s.v.filter(v => v >= 0))))].sort((a, b) => a - b);
const VMIN = VERSIONS[0], VMAX = VERSIONS[VERSIONS.length - 1];
function vbin(v) {
  if (VERSIONS.length <= 8) return VERSIONS.indexOf(v);
  return Math.min(7, Math.floor(8 * (v - VMIN) / (VMAX - VMIN + 1)));
}
function lpbin(lp) { return lp === null ? "lpn" : "lp" + LP_EDGES.filter(e => lp < e).length; }
function text(id) {
  const s = D.vocab ? D.vocab[id] : undefined;
  if (s === undefined || s === "") return "[" + id + "]";
  return s.replace(/\n/g, "\u21b5\n");  // a visible newline that still breaks the line
}

// one token: kind p (prompt), t (trained), u (model token, masked out), x (tool / template)
function token(id, kind, lp, v) {
  let cls = "tok " + kind, title = "id " + id + " \u00b7 " + JSON.stringify(D.vocab ? (D.vocab[id] ?? "") : "");
  if (kind === "t" || kind === "u") {
    cls += " " + lpbin(lp) + " v" + vbin(v);
    title += " \u00b7 logprob " + fmt(lp, 4) + " \u00b7 version " + v +
      (kind === "t" ? " \u00b7 trained" : " \u00b7 masked out");
  } else {
    title += kind === "p" ? " \u00b7 prompt" : " \u00b7 tool / template (not trained)";
  }
  const e = el("span", cls, text(id));
  e.title = title;
  return e;
}

function block(label, tokens) {
  const b = el("div", "block"), toks = el("div", "toks");
  toks.append(...tokens);
  b.append(el("span", "lab", label), toks);
  return b;
}

// a segment: the prompt, then alternating runs of model tokens (a turn) and inserted tokens. Turns are
// numbered over the whole trajectory (`first` is this segment's first); turn rewards belong to the turns of
// the last segment (agentflow.Trajectory.turn_rewards), counted from its first turn.
function segment(s, first, turnRewards) {
  const div = el("div", "seg");
  div.append(block("prompt", s.p.map(id => token(id, "p"))));
  let j = 0, turn = 0;
  while (j < s.ids.length) {
    const model = s.v[j] >= 0 || s.m[j] === 1, start = j;
    while (j < s.ids.length && (s.v[j] >= 0 || s.m[j] === 1) === model) j++;
    const toks = [];
    for (let q = start; q < j; q++) toks.push(token(s.ids[q], model ? (s.m[q] ? "t" : "u") : "x", s.lp[q], s.v[q]));
    let label = "tool / template";
    if (model) {
      turn += 1;
      label = "turn " + (first + turn - 1) +
        (turnRewards && turnRewards.length >= turn ? " \u00b7 r " + fmt(turnRewards[turn - 1], 3) : "");
    }
    div.append(block(label, toks));
  }
  div.dataset.turns = turn;
  return div;
}

function card(t) {
  const c = el("div", "card");
  const resp = t.segs.reduce((n, s) => n + s.ids.length, 0),
    trained = t.segs.reduce((n, s) => n + s.m.filter(m => m).length, 0);
  c.dataset.step = t.s;
  c.dataset.status = t.st;
  c.append(el("div", "head", "step " + t.s + " \u00b7 line " + t.i + " \u00b7 group " + t.g + " \u00b7 sample " + t.k +
    " \u00b7 reward " + fmt(t.r, 4) + " \u00b7 " + t.st + " \u00b7 " + resp + " response tokens, " + trained +
    " trained" + (t.nseg > 1 ? " \u00b7 " + t.nseg + " segments" : "") +
    (t.tr.length ? " \u00b7 turn rewards " + t.tr.map(r => fmt(r, 3)).join(", ") : "")));
  if (t.e) c.append(el("div", "err", t.e));
  let turns = 0;
  t.segs.forEach((s, n) => {
    if (t.nseg > 1) c.append(el("div", "lab", "segment " + (n + 1) + " of " + t.nseg +
      (n + 1 < t.nseg ? " (history rewritten after it)" : "")));
    const seg = segment(s, turns + 1, n === t.nseg - 1 ? t.tr : null);
    turns += +seg.dataset.turns;
    c.append(seg);
  });
  if (t.cut) c.append(el("div", "lab", t.cut + " more tokens not shown (--max-tokens)"));
  return c;
}

// --- state: colour mode and filters, mirrored in the URL's hash
const STATUSES = [...new Set(D.trajs.map(t => t.st))].sort();
const state = { mode: "mask", step: "all", status: new Set(STATUSES), rmin: "", rmax: "" };
function readHash() {
  const h = new URLSearchParams(location.hash.slice(1));
  if (["mask", "logprob", "version"].includes(h.get("mode"))) state.mode = h.get("mode");
  if (h.has("step")) state.step = h.get("step");
  if (h.has("status")) state.status = new Set(h.get("status").split(","));
  if (h.has("rmin")) state.rmin = h.get("rmin");
  if (h.has("rmax")) state.rmax = h.get("rmax");
}
function writeHash() {
  const h = new URLSearchParams({ mode: state.mode, step: state.step, status: [...state.status].join(",") });
  if (state.rmin !== "") h.set("rmin", state.rmin);
  if (state.rmax !== "") h.set("rmax", state.rmax);
  history.replaceState(null, "", "#" + h.toString());
}
function matches(t) {
  if (state.step !== "all" && String(t.s) !== state.step) return false;
  if (!state.status.has(t.st)) return false;
  if (state.rmin !== "" && !(t.r !== null && t.r >= +state.rmin)) return false;
  if (state.rmax !== "" && !(t.r !== null && t.r <= +state.rmax)) return false;
  return true;
}

let shown = [], rendered = 0;
function renderMore() {
  const list = document.getElementById("list");
  const next = shown.slice(rendered, rendered + PAGE);
  next.forEach(t => list.append(card(t)));
  rendered += next.length;
  document.getElementById("more").hidden = rendered >= shown.length;
  document.getElementById("count").textContent = shown.length + " of " + D.trajs.length + " trajectories match" +
    (rendered < shown.length ? " (" + rendered + " rendered)" : "");
  selfCheck();
}
function render() {
  document.body.dataset.mode = state.mode;
  shown = D.trajs.filter(matches);
  rendered = 0;
  document.getElementById("list").replaceChildren();
  renderMore();
  legend();
}
function legend() {
  const g = document.getElementById("legend");
  const item = (cls, label) => el("span", "tok " + cls, label);
  if (state.mode === "mask") g.replaceChildren(item("t", "trained"), item("u", "model, masked out"),
    item("x", "tool / template"), item("p", "prompt"));
  else if (state.mode === "logprob") g.replaceChildren(...["\u2265 -0.05", "-0.25", "-0.5", "-1", "-2", "-4", "< -4"]
    .map((l, k) => item("t lp" + k, k === 0 || k === 6 ? l : "\u2265 " + l)));
  else g.replaceChildren(...(VERSIONS.length <= 8 ? VERSIONS.map((v, k) => item("t v" + k, "version " + v))
    : [...Array(8).keys()].map(k => { const lo = VMIN + Math.ceil(k * (VMAX - VMIN + 1) / 8),
                                            hi = VMIN + Math.ceil((k + 1) * (VMAX - VMIN + 1) / 8) - 1;
                                     return item("t v" + k, "versions " + lo + "\u2013" + hi); })));
}
// what a test reads back from the DOM: counts of what is on screen
function selfCheck() {
  const b = document.body.dataset;
  b.matching = shown.length;
  b.rendered = rendered;
  b.tokens = document.querySelectorAll("#list .tok").length;
  b.trained = document.querySelectorAll("#list .tok.t").length;
  b.errors = errors;
  b.viewer = "ready";
}

function controls() {
  document.getElementById("title").textContent = D.title;
  const step = document.getElementById("step");
  step.append(el("option", "", "all steps"));
  step.lastChild.value = "all";
  D.steps.forEach(s => { step.append(el("option", "", "step " + s)); step.lastChild.value = String(s); });
  step.value = state.step;
  step.addEventListener("change", () => { state.step = step.value; writeHash(); render(); });
  const st = document.getElementById("statuses");
  STATUSES.forEach(s => {
    const box = el("input");
    box.type = "checkbox";
    box.checked = state.status.has(s);
    box.addEventListener("change", () => {
      box.checked ? state.status.add(s) : state.status.delete(s); writeHash(); render();
    });
    const lab = el("label");
    lab.append(box, document.createTextNode(" " + s + " (" + D.trajs.filter(t => t.st === s).length + ")"));
    st.append(lab);
  });
  for (const k of ["rmin", "rmax"]) {
    const box = document.getElementById(k);
    box.value = state[k];
    box.addEventListener("input", () => { state[k] = box.value.trim(); writeHash(); render(); });
  }
  document.querySelectorAll("input[name=mode]").forEach(r => {
    r.checked = r.value === state.mode;
    r.addEventListener("change", () => { state.mode = r.value; writeHash(); render(); });
  });
  document.getElementById("more").addEventListener("click", renderMore);
  const notes = document.getElementById("notes");
  D.notes.forEach(n => notes.append(el("div", "", n)));
}

readHash();
controls();
render();
"""

BODY = """<header>
<h1 id="title"></h1>
<div>colour <label><input type="radio" name="mode" value="mask"> loss mask</label>
<label><input type="radio" name="mode" value="logprob"> logprob</label>
<label><input type="radio" name="mode" value="version"> weight version</label>
<span id="legend"></span></div>
<div><label>step <select id="step"></select></label> status <span id="statuses"></span>
<label>reward &ge; <input type="number" step="any" id="rmin"></label>
<label>reward &le; <input type="number" step="any" id="rmax"></label> <span id="count"></span></div>
<div id="notes"></div>
</header>
<main><div id="list"></div><button id="more" hidden>show more</button></main>"""


def page(trajs: list[dict], vocab: dict[int, str] | None, title: str, notes: list[str]) -> str:
    """The whole HTML page: static markup and code, the data as one escaped JSON blob."""
    payload = {"title": title, "notes": notes, "vocab": vocab, "trajs": trajs,
               "steps": sorted({t["s"] for t in trajs})}
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>\n'
            f'<style>{STYLE}</style></head>\n<body data-mode="mask">\n{BODY}\n'
            f'<script type="application/json" id="viewer-data">{_script_json(payload)}</script>\n'
            f'<script>{SCRIPT}</script>\n</body></html>\n')


def build(path: str, output: str | None = None, tokenizer: str | None = None, steps: str = "",
          max_tokens: int = MAX_TOKENS) -> tuple[Path, dict]:
    """Write the page for a run dir / dump dir / jsonl file; returns its path and a summary."""
    if max_tokens < 1:
        raise ValueError(f"--max-tokens must be a positive number of tokens, got {max_tokens}")
    src = Path(path)
    files, cfg = rollout_files(src)
    if steps:
        want = parse_steps(steps)
        files = [(s, f) for s, f in files if s in want]
        if not files:
            raise ValueError(f"--steps {steps!r} matches none of the steps in {src}")
    trajs, total, probe = read_trajectories(files, max_tokens)
    tok, tok_note = load_tokenizer(tokenizer, cfg)
    notes = [tok_note]
    if tok is not None and probe and tok.decode(probe["ids"], skip_special_tokens=False) != probe["text"]:
        notes.append("WARNING: this tokenizer does not decode the trajectories' prompt ids to their prompt_text: "
                     "it is not the run's; token texts are likely wrong (pass the run's --tokenizer)")
    if len(trajs) < total:
        notes.append(f"showing {len(trajs)} of {total} trajectories: each of the {len(files)} step(s) keeps its first "
                     f"trajectories up to {max(1, max_tokens // len(files)):,} tokens (--max-tokens {max_tokens:,}); "
                     "choose steps with --steps or raise --max-tokens")
    vocab = token_texts(tok, trajs) if tok is not None else None
    steps_seen = sorted({s for s, _ in files})
    span = f"step {steps_seen[0]}" if len(steps_seen) == 1 else f"steps {steps_seen[0]}-{steps_seen[-1]}"
    title = f"{src.resolve().name}: {len(trajs)} trajectories, {span}"
    out = Path(output) if output else (src / "trajectories.html" if src.is_dir() else src.with_suffix(".html"))
    out.write_text(page(trajs, vocab, title, notes), encoding="utf-8")
    return out, {"trajectories": len(trajs), "total": total, "steps": len(files), "tokenizer": tok_note,
                 "bytes": out.stat().st_size}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Write one static HTML page showing the trajectories of a rollout dump.")
    ap.add_argument("path", help="a run dir (with config.yaml), a dump_rollouts dir, or one .jsonl file")
    ap.add_argument("-o", "--output", help="the HTML file (default: trajectories.html in the dir, or FILE.html)")
    ap.add_argument("--tokenizer", help="HF dir or run dir whose tokenizer decodes the tokens; 'none' shows ids")
    ap.add_argument("--steps", default="", help="only these steps, e.g. 0,3-5")
    ap.add_argument("--max-tokens", type=int, default=MAX_TOKENS, help="token budget of the page, split between steps")
    a = ap.parse_args(argv)
    out, s = build(a.path, a.output, a.tokenizer, a.steps, a.max_tokens)
    print(f"{out}: {s['trajectories']} of {s['total']} trajectories from {s['steps']} step(s), "
          f"{s['bytes'] / 1e6:.1f} MB; {s['tokenizer']}")


if __name__ == "__main__":
    main()
