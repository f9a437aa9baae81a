"""The engine contract table (rollout.CONTRACT) held to the code three ways.

What it proves: (1) every engine endpoint the client modules send (an AST walk over every string they hold, so a
path handed to a helper such as a per-engine post is seen too) is a row of the table, and every row is sent by some
client; (2) every route the CPU engine registers is a row or on the named list of routes served but never sent
(rollout.SERVED_NOT_SENT), and the CPU engine serves every row; (3) the default recipe, run behind a recording
proxy (tests/recording_engine.py, as a user's `engine:` launcher), sends only the "plain" rows, and the weight sync's.
"""

import ast
import re
from pathlib import Path

import pytest

import cpu_engine
import loongsage
import rollout

ROOT = Path(__file__).resolve().parent.parent
CLIENTS = ("rollout", "transfermesh", "fleet", "agentflow", "loongsage", "teacher", "trainer", "lora")
TABLE = {endpoint for endpoint, _, _ in rollout.CONTRACT}
PLAIN = {endpoint for endpoint, feature, _ in rollout.CONTRACT if feature == "plain"}
ENDPOINT = re.compile(r"/[a-z_]+")


def sent_endpoints() -> dict[str, set[str]]:
    """{module: the endpoint paths its strings hold}. A path built around a formatted value (f"/{call}_memory_...")
    comes back as a regular expression over the table's endpoints; the router's own routes (Route("/health", ...))
    are the router's, not an engine's, and are left out."""
    found = {}
    for mod in CLIENTS:
        tree = ast.parse((ROOT / f"{mod}.py").read_text())
        routes = {id(call.args[0]) for call in ast.walk(tree) if isinstance(call, ast.Call) and call.args
                  and getattr(call.func, "id", getattr(call.func, "attr", "")) == "Route"}
        tables = [n for n in tree.body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") in
                  ("CONTRACT", "SERVED_NOT_SENT")]  # the table itself sends nothing
        routes |= {id(c) for t in tables for c in ast.walk(t)}
        routes |= {id(p) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for p in n.values}  # read below
        out = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in routes:
                if ENDPOINT.fullmatch(node.value):
                    out.add(node.value)
            elif isinstance(node, ast.JoinedStr):
                parts = node.values
                # f"{url}/generate": a path right after the one value that opens the string (an f"{a}{b}/x" or
                # f"eval/{src}/accuracy" is a metric's name)
                if len(parts) >= 2 and isinstance(parts[0], ast.FormattedValue) and isinstance(parts[1], ast.Constant) \
                        and ENDPOINT.fullmatch(parts[1].value):
                    out.add(parts[1].value)
                if isinstance(parts[0], ast.Constant) and parts[0].value == "/" and len(parts) == 3 \
                        and re.fullmatch(r"_[a-z_]+", parts[2].value):
                    out.add("re:/[a-z]+" + re.escape(parts[2].value))  # f"/{call}_memory_occupation"
        found[mod] = out
    return found


def test_every_endpoint_the_clients_send_is_in_the_table_and_every_row_is_sent():
    found = sent_endpoints()
    literal = {e for es in found.values() for e in es if not e.startswith("re:")}
    patterns = [e[3:] for es in found.values() for e in es if e.startswith("re:")]
    # strings that look like a path but name no endpoint: the router's scoped prefix and a file system root
    not_endpoints = {"/v1", "/s"}
    unknown = literal - TABLE - not_endpoints
    assert not unknown, f"sent to engines but missing from rollout.CONTRACT: {sorted(unknown)}"
    for p in patterns:
        assert any(re.fullmatch(p, e) for e in TABLE), f"{p} matches no row of rollout.CONTRACT"
    unsent = {e for e in TABLE if e not in literal and not any(re.fullmatch(p, e) for p in patterns)}
    assert not unsent, f"rows of rollout.CONTRACT that no client sends: {sorted(unsent)}"
    assert found["transfermesh"] >= {"/begin_weight_update", "/update_weights_from_tensor", "/end_weight_update"}


def test_the_cpu_engine_serves_the_table_and_names_what_else_it_serves(tiny_model_dir):
    engine = cpu_engine.CpuEngine(tiny_model_dir, max_batch=1, max_len=32)
    app = cpu_engine.build_app(engine)
    docs = {"/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}  # FastAPI's own pages
    served = {r.path for r in app.routes} - docs
    assert served - TABLE - set(rollout.SERVED_NOT_SENT) == set(), "served, but neither in the table nor listed"
    assert TABLE - served == set(), "rows the CPU engine does not serve"
    assert set(rollout.SERVED_NOT_SENT) <= served and not TABLE & set(rollout.SERVED_NOT_SENT)


@pytest.mark.slow
def test_the_default_recipe_sends_only_the_plain_rows(tmp_path, run_cache, ray_session):
    from test_loongsage import _short_run  # the suite's shrunk default recipe
    cfg = _short_run(tmp_path, "num_steps=2", "eval_every=1", "engine=tests.recording_engine:start")
    history = loongsage.train(cfg)
    record = Path(cfg.output_dir) / "engine_calls.txt"
    assert len([h for h in history if "train/loss" in h]) == 2
    calls = [line.split(" ", 1)[1] for line in record.read_text().splitlines()]
    print({c: calls.count(c) for c in sorted(set(calls))})
    assert set(calls) <= PLAIN, f"a plain run sent rows of other features: {sorted(set(calls) - PLAIN)}"
    assert {"/generate", "/pause_generation", "/begin_weight_update", "/update_weights_from_tensor",
            "/end_weight_update", "/continue_generation"} <= set(calls)
