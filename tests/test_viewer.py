"""The trajectory viewer (viewer.py), its page opened in headless Chromium.

A real tiny run (Ray, Megatron-Core over gloo, the CPU engine over HTTP, AgentFlow with a two-turn agent on
the official openai client, 2 GRPO steps, dump_rollouts) writes the rollouts; `python viewer.py RUN_DIR`
writes the page; Chromium renders it: the page's data and DOM counts match the dump, its screenshot has
pixels of each colour mode, filters in the URL's hash select what the dump says they should, and no console
message is logged. Hand-built files add what a tiny run cannot be made to produce on demand: markup in every
text field, boundary rewards, several segments, more trajectories than a page of cards, the token cap.

Chromium is Debian's `chromium` (.ci/run installs it). Without it the browser tests skip, saying so; under
CI=true they fail instead.
"""
import html
import json
import math
import os
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

import viewer

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=128, norm_std=0.2)  # tests/conftest.py's tiny_model_dir
TRAINED = (127, 214, 127)   # viewer.STYLE: mask mode, .t
TOOL = (207, 224, 247)      # mask mode, .x
VERSION0 = (141, 211, 199)  # version mode, .v0 (the first version on the page)
LOGPROB = [(255, 247, 188), (254, 227, 145), (254, 196, 79), (254, 153, 41), (236, 112, 20), (204, 76, 2),
           (140, 45, 4)]    # logprob mode, .lp0 .. .lp6


@pytest.fixture(scope="module")
def chromium() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe:
        return exe
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail("CI=true but chromium is not on PATH: .ci/run installs Debian's chromium with apt-get; its log "
                    "says why that failed", pytrace=False)
    pytest.skip("chromium is not installed (apt-get install -y chromium); CI installs it and runs these tests")


def browse(exe: str, page: Path, tmp: Path, hash_: str = "", screenshot: bool = False):
    """Open page#hash in headless Chromium: the DOM after the page's scripts ran (or a screenshot's pixel
    counts {rgb: n}), and every console line (the page logs nothing, so any line is an error or a warning)."""
    shot = tmp / f"shot-{uuid.uuid4().hex[:8]}.png"
    p = subprocess.run([exe, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                        "--window-size=1200,900", "--enable-logging=stderr", "--v=0",
                        f"--user-data-dir={tmp / 'chromium-profile'}",
                        f"--screenshot={shot}" if screenshot else "--dump-dom", page.as_uri() + hash_],
                       capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    console = [line for line in p.stderr.splitlines() if ":CONSOLE" in line]
    if not screenshot:
        return p.stdout, console
    from PIL import Image
    im = Image.open(shot).convert("RGB")
    return {rgb: n for n, rgb in im.getcolors(maxcolors=im.width * im.height)}, console


def body_state(dom: str) -> dict:
    """The counts the page's selfCheck writes on <body>."""
    attrs = re.search(r"<body([^>]*)>", dom).group(1)
    return dict(re.findall(r'data-([\w-]+)="([^"]*)"', attrs))


def page_data(page: Path) -> dict:
    """The JSON the page carries (its '\\u003c'-style escapes are plain JSON escapes)."""
    text = page.read_text(encoding="utf-8")
    return json.loads(re.search(r'<script type="application/json" id="viewer-data">(.*?)</script>', text, re.S).group(1))


def trained_segments(t: dict) -> list[dict]:
    """What the trainer trains (trainer.segment_rows): earlier segments as dumped, the last one top-level."""
    return [*(t.get("segments") or [])[:-1], t]


# ----------------------------------------------------------------------------------------------
# a real run


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_model_dir) -> Path:
    """2 GRPO steps of 2 prompts x 4 samples, the two-turn agent, rollouts dumped inside the run dir."""
    import ray
    import loongsage
    tmp = tmp_path_factory.mktemp("viewer")
    cfg = loongsage.load_config(str(ROOT / "recipes/arith_cpu.yaml"), [
        f"output_dir={tmp}/run", f"model_path={tiny_model_dir}", "warmstart_steps=0", f"dump_rollouts={tmp}/run/rollouts",
        "num_steps=2", "prompts_per_step=2", "samples_per_prompt=4", "global_batch_size=8", "micro_batch_size=4",
        "eval_every=0", "agent=tests.viewer_agents.two_turns", "reward=tests.rewards.text_hash", "max_turns=4"])
    try:
        loongsage.train(cfg)
    finally:
        if ray.is_initialized():
            ray.shutdown()
    return tmp / "run"


def _dumped(run_dir: Path) -> list[dict]:
    return [{**json.loads(line), "step": s} for s in (0, 1)
            for line in (run_dir / "rollouts" / f"step_{s:05d}.jsonl").read_text().splitlines()]


def test_page_of_a_real_run_in_chromium(run_dir, tiny_model_dir, chromium, tmp_path):
    """`python viewer.py RUN_DIR` on a real run: the page holds every dumped trajectory token for token,
    decoded with the run's tokenizer (found through config.yaml), and Chromium renders exactly the dump's
    tokens, trained tokens and turns, with the hover data of each token, no console message, and the
    markup of the agent's error and follow-up message shown as text."""
    page = tmp_path / "page.html"
    p = subprocess.run([sys.executable, "viewer.py", str(run_dir), "-o", str(page)], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    trajs = _dumped(run_dir)
    assert len(trajs) == 16 and f"16 of 16 trajectories from 2 step(s)" in p.stdout
    assert {t["status"] for t in trajs} == {"ok", "failed"}  # the agent fails ~1/3 (P(none of 16) ~ 0.2%)

    data = page_data(page)
    # config.yaml names the model dir; its tokenizer decodes the prompts to their prompt_text (no warning note)
    assert data["notes"] == [f"tokens decoded with the tokenizer of {tiny_model_dir}"]
    assert len(data["trajs"]) == 16
    for t, c in zip(trajs, data["trajs"]):
        assert (c["s"], c["g"], c["k"], c["st"]) == (t["step"], t["group_id"], t["sample_index"], t["status"])
        assert c["r"] == pytest.approx(t["reward"])
        segs = trained_segments(t)
        assert len(c["segs"]) == len(segs) == c["nseg"]
        for s, cs in zip(segs, c["segs"]):
            assert cs["p"] == s["prompt_ids"] and cs["ids"] == s["response_ids"]
            assert cs["m"] == s["loss_mask"] and cs["v"] == s["weight_versions"]
            assert cs["lp"] == pytest.approx(s["rollout_logprobs"], abs=1e-4)
        # per-token texts, joined, give back the prompt text the run decoded (ASCII prompts: no split characters)
        assert "".join(data["vocab"][str(i)] for i in t["prompt_ids"]) == t["prompt_text"]
        if t["status"] == "ok":
            assert c["tr"] == [0.25, 0.75]
        else:
            assert sum(t["loss_mask"]) == 0 and "fails on purpose" in c["e"]

    dom, console = browse(chromium, page, tmp_path)
    assert console == []
    state = body_state(dom)
    tokens = sum(len(s["prompt_ids"]) + len(s["response_ids"]) for t in trajs for s in trained_segments(t))
    trained = sum(sum(s["loss_mask"]) for t in trajs for s in trained_segments(t))
    assert state == {"mode": "mask", "matching": "16", "rendered": "16", "tokens": str(tokens),
                     "trained": str(trained), "errors": "0", "viewer": "ready"}
    assert trained > 0 and dom.count('class="tok t ') == trained
    # masked-out model tokens: the failed trajectories' own tokens (their loss mask was zeroed, versions kept)
    assert dom.count('class="tok u ') == sum(1 for t in trajs for s in trained_segments(t)
                                             for m, v in zip(s["loss_mask"], s["weight_versions"]) if not m and v >= 0) > 0
    # every trajectory shows its two model turns, and the follow-up between them as tool / template tokens
    assert dom.count('class="lab">turn 2') == sum(1 for t in trajs if t["metadata"]["turns"] == 2) >= 14
    # hover data: the first trained token of each trajectory, with its logprob and version
    titles = {html.unescape(x) for x in re.findall(r'title="([^"]*)"', dom)}
    for t in trajs:
        j = t["loss_mask"].index(1) if any(t["loss_mask"]) else None
        if j is not None:
            tid = t["response_ids"][j]
            assert (f"id {tid} \u00b7 {json.dumps(data['vocab'][str(tid)], ensure_ascii=False)} \u00b7 logprob "
                    f"{t['rollout_logprobs'][j]:.4f} \u00b7 version {t['weight_versions'][j]} \u00b7 trained") in titles
    # markup from the run (the agent's error, the user's follow-up) is text, never elements
    assert "pwned" not in state and "<img" not in dom and "<b>" not in dom
    assert dom.count("&lt;img src=x onerror=") == sum(t["status"] == "failed" for t in trajs)

    # filters from the URL's hash select what the dump says they should
    for hash_, want in [("#status=failed", sum(t["status"] == "failed" for t in trajs)),
                        ("#step=1", 8),
                        ("#step=1&rmin=0.5", sum(t["step"] == 1 and t["reward"] >= 0.5 for t in trajs)),
                        ("#status=ok&rmax=0.5", sum(t["status"] == "ok" and t["reward"] <= 0.5 for t in trajs))]:
        dom, console = browse(chromium, page, tmp_path, hash_)
        assert console == [] and body_state(dom)["matching"] == str(want), hash_

    # the colours on screen: mask mode shows trained and tool/template tokens; the other modes recolour them
    px, console = browse(chromium, page, tmp_path, screenshot=True)
    assert console == [] and px.get(TRAINED, 0) > 1500 and px.get(TOOL, 0) > 1500, (px.get(TRAINED), px.get(TOOL))
    px, _ = browse(chromium, page, tmp_path, "#mode=version", screenshot=True)
    assert px.get(TRAINED, 0) == 0 and px.get(VERSION0, 0) > 1500  # step 0 (on top) was sampled by version 0
    px, _ = browse(chromium, page, tmp_path, "#mode=logprob", screenshot=True)
    assert px.get(TRAINED, 0) == 0 and sum(px.get(c, 0) for c in LOGPROB) > 1500
