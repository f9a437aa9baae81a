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
import concurrent.futures
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
                        # a screenshot waits until the page is idle (up to 5 s of virtual time), not just loaded, and
                        # every tile is rastered before the frame is drawn: without the second flag a loaded machine
                        # could shoot the page with tiles still blank (the real run's mask shot counted 610 trained
                        # and 9,190 tool pixels twice, in CI and in a full suite here, where whole frames count 7,068
                        # and 24,900; 1 shot in 18 came out partial with both cores busy, 0 in 40 with the flag)
                        *(["--virtual-time-budget=5000", "--run-all-compositor-stages-before-draw"] if screenshot else []),
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
def run_dir(tmp_path_factory, tiny_model_dir, ray_session) -> Path:
    """2 GRPO steps of 2 prompts x 4 samples, the two-turn agent, rollouts dumped inside the run dir."""
    import config
    import loongsage
    tmp = tmp_path_factory.mktemp("viewer")
    cfg = config.load_config(str(ROOT / "recipes/arith_cpu.yaml"), [
        f"output_dir={tmp}/run", f"model_path={tiny_model_dir}", "warmstart_steps=0", f"dump_rollouts={tmp}/run/rollouts",
        "num_steps=2", "prompts_per_step=2", "samples_per_prompt=4", "global_batch_size=8", "micro_batch_size=4",
        "eval_every=0", "agent=tests.viewer_agents.two_turns", "reward=tests.rewards.text_hash", "max_turns=4"])
    loongsage.train(cfg)
    return tmp / "run"


def _dumped(run_dir: Path) -> list[dict]:
    return [{**json.loads(line), "step": s} for s in (0, 1)
            for line in (run_dir / "rollouts" / f"step_{s:05d}.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_page_of_a_real_run_in_chromium(chromium, run_dir, tiny_model_dir, tmp_path):  # no chromium: skip before the run
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


@pytest.mark.slow
def test_the_tiny_tokenizer_is_rebuilt_for_a_run_of_the_tiny_model(run_dir, tmp_path):
    """A run with model_path: tiny names no directory; the viewer rebuilds the tiny tokenizer from the run's
    tiny_model settings and decodes the real run's prompts exactly as the run did (no warning). A tokenizer of
    another vocabulary size does not, and the page says so."""
    import yaml
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    for vocab, warned in ((384, False), (300, True)):
        other = tmp_path / f"run{vocab}"
        other.mkdir()
        (other / "config.yaml").write_text(yaml.safe_dump({**cfg, "model_path": "tiny",
                                                           "tiny_model": {**TINY, "tokenizer_vocab": vocab}}))
        out, summary = viewer.build(str(run_dir / "rollouts"), str(tmp_path / f"p{vocab}.html"), tokenizer=str(other))
        data = page_data(out)
        assert data["notes"][0] == f"tokens decoded with the tiny tokenizer (vocab {vocab}, rebuilt)"
        assert ("WARNING" in " ".join(data["notes"])) is warned
        t = json.loads((run_dir / "rollouts" / "step_00000.jsonl").read_text().splitlines()[0])
        assert ("".join(data["vocab"][str(i)] for i in t["prompt_ids"]) == t["prompt_text"]) is not warned


# ----------------------------------------------------------------------------------------------
# hand-built rollout files


def _traj(reward=0.5, status="ok", group=0, sample=0, version=0, n_prompt=4, turns=((3, 2),), error="", segments=()):
    """A trajectory dict as AgentFlow dumps it: `turns` = (model tokens, inserted tokens after them) per turn;
    token ids count up from 10 so every token is distinct."""
    ids, mask, lp, ver = [], [], [], []
    for model, inserted in turns:
        ids += range(10 + len(ids), 10 + len(ids) + model + inserted)
        mask += [1] * model + [0] * inserted
        lp += [-0.1 * (k + 1) for k in range(model)] + [0.0] * inserted
        ver += [version] * model + [-1] * inserted
    if status == "failed":
        mask = [0] * len(mask)
    top = dict(prompt_ids=list(range(1, n_prompt + 1)), response_ids=ids, loss_mask=mask, rollout_logprobs=lp,
               weight_versions=ver)
    return dict(top, segments=[*segments, top], reward=reward, status=status, group_id=group, sample_index=sample,
                metadata={"error": error} if error else {}, prompt_text="")


def _write(path: Path, trajs: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(t) + "\n" for t in trajs))
    return path


def test_the_browser_harness_sees_console_messages_and_page_errors(chromium, tmp_path):
    """The checks above would pass vacuously if Chromium's console lines or the page's error counter never
    reached the test: a page that logs and throws is seen doing both."""
    out, _ = viewer.build(str(_write(tmp_path / "step_00000.jsonl", [_traj()])))
    bad = tmp_path / "bad.html"
    bad.write_text(out.read_text(encoding="utf-8").replace(
        "</body>", '<script>console.error("logged on purpose"); null.boom;</script></body>'), encoding="utf-8")
    dom, console = browse(chromium, bad, tmp_path)
    assert body_state(dom)["errors"] == "1" and body_state(dom)["viewer"] == "ready"
    assert len(console) == 2 and "logged on purpose" in console[0] and "TypeError" in console[1]


def test_model_output_cannot_inject_markup(chromium, tmp_path):
    """Every text field a rollout file controls (token texts, status, error, the title) carries markup that
    would run a script or add an element if it were parsed: the page holds exactly its own two scripts, its
    data round-trips the strings unchanged, and Chromium shows them as text with no element, no script run
    and no console message."""
    evil = ['</script><script>document.body.dataset.pwned="script"</script>',
            '<img src=x onerror="document.body.dataset.pwned=\'img\'">', "<!--", "]]>", "&amp; \u2028 \\u003c"]
    trajs = [_traj(status=evil[0], error=evil[1] + evil[2]), _traj(reward=1.0, group=1, error=evil[3] + evil[4])]
    compact = [viewer.compact(t, 0, i + 1, 10 ** 6, "hand-built")[0] for i, t in enumerate(trajs)]
    vocab = {i: evil[i % len(evil)] for i in range(40)}
    page = tmp_path / "evil.html"
    page.write_text(viewer.page(compact, vocab, title=evil[0], notes=[evil[1]]), encoding="utf-8")
    text = page.read_text(encoding="utf-8")
    assert len(re.findall(r"<script", text, re.I)) == 2 and len(re.findall(r"</script", text, re.I)) == 2
    data = page_data(page)
    assert data["vocab"] == {str(k): v for k, v in vocab.items()} and data["title"] == evil[0]
    assert data["trajs"][0]["st"] == evil[0] and data["trajs"][0]["e"] == evil[1] + evil[2]

    dom, console = browse(chromium, page, tmp_path)
    state = body_state(dom)
    assert console == [] and state["viewer"] == "ready" and state["errors"] == "0" and "pwned" not in state
    assert "<img" not in dom and dom.count("<script") == 2
    assert dom.count("&lt;img src=x onerror=") >= 3  # the error, the note and token texts, shown as text
    n_tokens = sum(len(t["prompt_ids"]) + len(t["response_ids"]) for t in trajs)
    assert state["tokens"] == str(n_tokens)


@pytest.mark.slow
def test_filters_steps_segments_and_paging_in_chromium(chromium, tmp_path):
    """A dump dir of two steps (0 and 2): reward bounds are inclusive and a null (non-finite) reward matches
    no bound; statuses and steps filter; a compacted trajectory shows both segments and numbers its turns
    across them; 120 trajectories in a step render 50 cards at a time; without config.yaml or --tokenizer
    the page shows token ids and says why."""
    compacted = _traj(reward=0.25, group=7, turns=((2, 1), (2, 0)),
                      segments=[dict(prompt_ids=[1, 2], response_ids=[50, 51, 52], loss_mask=[1, 1, 0],
                                     rollout_logprobs=[-0.5, -0.5, 0.0], weight_versions=[0, 0, -1])])
    step0 = [_traj(0.0), _traj(0.5, sample=1), _traj(1.0, sample=2), _traj(float("nan"), sample=3),
             _traj(0.0, status="failed", sample=4, error="agent raised"), _traj(0.5, status="truncated", sample=5),
             compacted]
    step2 = [_traj(0.1 * (k % 10), group=k // 8, sample=k % 8, version=2) for k in range(120)]
    _write(tmp_path / "dump" / "step_00000.jsonl", step0)
    _write(tmp_path / "dump" / "step_00002.jsonl", step2)
    out, summary = viewer.build(str(tmp_path / "dump"))
    assert out == tmp_path / "dump" / "trajectories.html" and summary["trajectories"] == summary["total"] == 127
    data = page_data(out)
    assert data["vocab"] is None and data["notes"][0].startswith("token ids shown: no config.yaml")
    assert data["steps"] == [0, 2] and data["trajs"][3]["r"] is None  # NaN travels as null

    expect = {
        "": (127, 50),
        "#step=0": (7, 7),
        "#step=0&rmin=0.5": (3, 3),             # 0.5, 1.0, truncated 0.5: inclusive, NaN excluded
        "#step=0&rmin=0.25&rmax=0.5": (3, 3),   # 0.5, truncated 0.5, compacted 0.25
        "#step=0&status=failed,truncated": (2, 2),
        "#step=2&rmax=0.25": (36, 36),          # rewards 0.0, 0.1, 0.2 of 0.0 .. 0.9, 12 each
        "#step=2&rmin=0.85": (12, 12),
        "#status=nope": (0, 0),
    }

    def browse_apart(k, hash_):  # each Chromium with a profile of its own: one profile takes one browser at a time
        (tmp_path / f"hash{k}").mkdir()
        return browse(chromium, out, tmp_path / f"hash{k}", hash_)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:  # the eight pages, four browsers at a time
        doms = list(pool.map(browse_apart, range(len(expect)), expect))
    for (hash_, (matching, rendered)), (dom, console) in zip(expect.items(), doms):
        state = body_state(dom)
        assert console == [] and state["errors"] == "0", hash_
        assert (int(state["matching"]), int(state["rendered"])) == (matching, rendered), hash_
    # the controls, used as a reader would: "show more", then the logprob mode, step 2 and a reward bound;
    # every change re-renders and rewrites the URL's hash
    clicks = tmp_path / "dump" / "clicks.html"
    clicks.write_text(out.read_text(encoding="utf-8").replace("</body>", """<script>
document.getElementById("more").click();
document.body.dataset.afterMore = document.body.dataset.rendered;
document.querySelector("input[name=mode][value=logprob]").click();
const step = document.getElementById("step"); step.value = "2"; step.dispatchEvent(new Event("change"));
const rmin = document.getElementById("rmin"); rmin.value = "0.85"; rmin.dispatchEvent(new Event("input"));
document.body.dataset.hash = location.hash;
</script></body>"""), encoding="utf-8")
    dom, console = browse(chromium, clicks, tmp_path)
    state = body_state(dom)
    assert console == [] and state["errors"] == "0" and state["after-more"] == "100"
    assert (state["mode"], state["matching"], state["rendered"]) == ("logprob", "12", "12")
    assert state["hash"] == "#mode=logprob&amp;step=2&amp;status=failed%2Cok%2Ctruncated&amp;rmin=0.85"

    dom, _ = browse(chromium, out, tmp_path, "#step=0&rmin=0.25&rmax=0.25")
    assert body_state(dom)["matching"] == "1"
    assert "segment 1 of 2 (history rewritten after it)" in dom and "segment 2 of 2" in dom
    labels = re.findall(r'class="lab">(turn \d)', dom)
    assert labels == ["turn 1", "turn 2", "turn 3"]  # one turn in the first segment, two in the last
    assert body_state(dom)["tokens"] == str(2 + 3 + 4 + 5) and body_state(dom)["trained"] == str(2 + 4)
    assert '[50]' in dom  # no tokenizer: ids


def test_token_cap_keeps_every_step_and_says_so(tmp_path):
    """--max-tokens splits its budget equally between the steps: each keeps its first trajectories that fit,
    the first one always (cut to the share), and the page notes how many it shows of how many."""
    for s in range(3):
        _write(tmp_path / "dump" / f"step_{s:05d}.jsonl", [_traj(group=k, n_prompt=50, turns=((30, 20),))
                                                          for k in range(10)])
    out, summary = viewer.build(str(tmp_path / "dump"), str(tmp_path / "a.html"), max_tokens=1500)
    data = page_data(out)
    assert (summary["trajectories"], summary["total"]) == (15, 30)  # 500 tokens a step: 5 of 100 tokens each
    assert [t["s"] for t in data["trajs"]] == [0] * 5 + [1] * 5 + [2] * 5 and all(t["cut"] == 0 for t in data["trajs"])
    assert data["notes"][-1].startswith("showing 15 of 30 trajectories: each of the 3 step(s) keeps its first "
                                        "trajectories up to 500 tokens (--max-tokens 1,500)")
    out, summary = viewer.build(str(tmp_path / "dump"), str(tmp_path / "b.html"), max_tokens=140, steps="1-2")
    data = page_data(out)
    assert (summary["trajectories"], summary["total"]) == (2, 20) and [t["s"] for t in data["trajs"]] == [1, 2]
    for t in data["trajs"]:  # 70 tokens a step: the first trajectory, cut after its prompt and 20 response tokens
        assert len(t["segs"][0]["p"]) == 50 and len(t["segs"][0]["ids"]) == 20 and t["cut"] == 30
        assert len(t["segs"][0]["m"]) == len(t["segs"][0]["lp"]) == len(t["segs"][0]["v"]) == 20


def test_bad_input_says_what_and_what_to_do(tmp_path):
    """Each way to point the viewer at the wrong thing gets an error naming the value and the fix."""
    with pytest.raises(FileNotFoundError, match="does not exist; give a run dir"):
        viewer.build(str(tmp_path / "nowhere"))
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("model_path: tiny\ndump_rollouts: ''\noutput_dir: run\n")
    with pytest.raises(ValueError, match="has no rollouts: its config.yaml has dump_rollouts=''; run with dump_rollouts=DIR"):
        viewer.build(str(run))
    (run / "config.yaml").write_text("model_path: tiny\ndump_rollouts: gone\noutput_dir: run\n")
    with pytest.raises(FileNotFoundError, match="dump_rollouts='gone', which is not at"):
        viewer.build(str(run))
    f = _write(tmp_path / "d" / "step_00000.jsonl", [_traj()])
    with open(f, "a") as fh:
        fh.write('{"prompt_ids": [1], "response_ids": [2, 3], "loss_mask": [1]}\n{not json\n')
    with pytest.raises(ValueError, match=r"step_00000.jsonl:2 is not a LoongSage trajectory: it lacks \['rollout_logprobs', 'weight_versions'\]"):
        viewer.build(str(f))
    f.write_text(json.dumps(_traj()) + "\n" + json.dumps({**_traj(), "loss_mask": [1]}) + "\n")
    with pytest.raises(ValueError, match=r"step_00000.jsonl:2: \['loss_mask'\] do not have one entry per response token \(5\)"):
        viewer.build(str(f))
    f.write_text(json.dumps(_traj()) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"step_00000.jsonl:2 is not JSON"):
        viewer.build(str(f))
    with pytest.raises(ValueError, match=r"--steps '1-x': '1-x' is not a step or a range"):
        viewer.build(str(tmp_path / "d"), steps="1-x")
    _write(f, [_traj()])
    with pytest.raises(ValueError, match=r"--steps '3' matches none of the steps"):
        viewer.build(str(tmp_path / "d"), steps="3")
    with pytest.raises(ValueError, match=r"--tokenizer '.*nope' could not be loaded"):
        viewer.build(str(f), tokenizer=str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="--max-tokens must be a positive number of tokens, got 0"):
        viewer.build(str(f), max_tokens=0)


def test_a_relative_dump_dir_is_found_from_where_the_run_was_launched(tmp_path, monkeypatch):
    """config.yaml keeps the paths it was given: dump_rollouts relative to the launch directory, which
    output_dir (relative to the same place) locates, whatever the viewer's own working directory."""
    run = tmp_path / "proj" / "runs" / "x"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("model_path: tiny\noutput_dir: runs/x\ndump_rollouts: dumps/x\n")
    _write(tmp_path / "proj" / "dumps" / "x" / "step_00004.jsonl", [_traj()])
    monkeypatch.chdir(tmp_path)
    files, cfg = viewer.rollout_files(run)
    assert files == [(4, tmp_path / "proj" / "dumps" / "x" / "step_00004.jsonl")] and cfg["output_dir"] == "runs/x"
