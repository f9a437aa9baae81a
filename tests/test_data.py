"""data.py: the tiny tokenizer/model builder, the chat template, datasets and rewards."""
import json
import random

import pytest

import chat
import data


def test_tiny_model_is_deterministic_and_cached(tmp_path, tiny_model_dir):
    from safetensors.torch import load_file
    settings = json.loads((data.Path(tiny_model_dir) / "loongsage_tiny.json").read_text())
    kwargs = settings
    p = data.build_tiny_model(tmp_path / "again", **kwargs)
    a, b = load_file(f"{tiny_model_dir}/model.safetensors"), load_file(f"{p}/model.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    assert (data.Path(tiny_model_dir) / "tokenizer.json").read_text() == (data.Path(p) / "tokenizer.json").read_text()
    mtime = (data.Path(p) / "model.safetensors").stat().st_mtime
    data.build_tiny_model(tmp_path / "again", **kwargs)  # same settings: reused, not rebuilt
    assert (data.Path(p) / "model.safetensors").stat().st_mtime == mtime
    data.build_tiny_model(tmp_path / "again", **{**kwargs, "seed": 1})  # other settings: rebuilt
    assert not (load_file(f"{p}/model.safetensors")["lm_head.weight"] == a["lm_head.weight"]).all()


def test_unknown_tiny_setting_is_named(tmp_path):
    with pytest.raises(ValueError, match="hiden_size"):
        data.build_tiny_model(tmp_path, hiden_size=3)


def test_tokenizer_digits_special_tokens_and_template(tiny_model_dir):
    tok = data.load_tokenizer(tiny_model_dir)
    assert len(tok) <= 400 and tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert [tok.decode([i]) for i in tok.encode("1234", add_special_tokens=False)] == ["1", "2", "3", "4"]
    for special in chat.FAMILIES["chatml"]["special"]:  # each is one token
        assert len(tok.encode(special, add_special_tokens=False)) == 1
    text = tok.apply_chat_template([{"role": "user", "content": "12+7"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\n12+7<|im_end|>\n<|im_start|>assistant\n"
    msgs = [{"role": "user", "content": "(1+2)*3"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "(1+2)*3"}}}]},
            {"role": "tool", "content": "9"}, {"role": "assistant", "content": "9"}]
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
    text = tok.apply_chat_template(msgs, tools=tools, tokenize=False)
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "(1+2)*3"}}\n'
            "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n9\n</tool_response><|im_end|>\n") in text
    assert text.startswith("<|im_start|>system\n# Tools\n") and '"name": "calculator"' in text.split("<|im_end|>")[0]
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text  # byte-level: lossless


def test_arith_samples_are_correct_and_seeded():
    a, b = data.arith_samples(200, 3), data.arith_samples(200, 3)
    assert a == b and a != data.arith_samples(200, 4)
    for s in a:
        assert eval(s["messages"][0]["content"]) == int(s["answer"]) and int(s["answer"]) >= 0
    assert all(eval(s["messages"][0]["content"]) == int(s["answer"]) for s in data.calc_samples(50, 0))


def test_sft_trajectory_and_label_noise(tiny_model_dir):
    tok = data.load_tokenizer(tiny_model_dir)
    s = {"messages": [{"role": "user", "content": "12+7"}], "answer": "19"}
    t = data.sft_trajectory(tok, s)
    assert tok.decode(t["response_ids"]) == "19<|im_end|>" and t["loss_mask"] == [1, 1, 1]
    assert tok.decode(t["prompt_ids"]).endswith("<|im_start|>assistant\n")
    rng = random.Random(0)
    answers = [tok.decode(data.sft_trajectory(tok, s, rng, 0.6)["response_ids"][:-1]) for _ in range(2000)]
    assert set(answers) == {"18", "19", "20"}
    assert abs(answers.count("19") / 2000 - 0.4) < 0.04


def test_rewards():
    s = {"answer": "19"}
    assert data.exact_match(" 19\n", s) == 1.0 and data.exact_match("19.", s) == 0.0
    assert data.char_match("19", s) == 1.0 and data.char_match("18", s) == 0.5 and data.char_match("190", s) == 2 / 3
    assert data.last_number_match("so it is 19", s) == 1.0 and data.last_number_match("20", s) == 0.0
    assert data.math_verify("The answer is $\\boxed{19}$", s) == 1.0
    assert data.math_verify("The answer is $\\boxed{18}$", s) == 0.0


def test_load_dataset(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps({"prompt": "1+1", "answer": "2"}) + "\n" + json.dumps({"messages": [{"role": "user", "content": "x"}]}) + "\n")
    rows = data.load_dataset(str(p))
    assert rows[0]["messages"] == [{"role": "user", "content": "1+1"}] and len(rows) == 2
    assert len(data.load_dataset("synthetic:arith:10:0")) == 10
    with pytest.raises(ValueError, match="synthetic:arith"):
        data.load_dataset("synthetic:foo:1:2")
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        data.load_dataset("nope.jsonl")
    p.write_text(json.dumps({"question": "?"}) + "\n")
    with pytest.raises(ValueError, match="row 0"):
        data.load_dataset(str(p))


def test_load_parquet_dataset(tmp_path):
    """A .parquet file loads like the same rows in .jsonl: chat rows kept, prompt rows wrapped as one user turn
    (even though parquet stores the prompt row's missing `messages` as a null), extra columns kept."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    rows = [{"prompt": "1+1", "answer": "2", "level": 1},
            {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "3+4"}], "answer": "7"}]
    keys = ["prompt", "answer", "level", "messages"]
    pq.write_table(pa.table({k: [r.get(k) for r in rows] for k in keys}), tmp_path / "d.parquet")
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = data.load_dataset(str(tmp_path / "d.parquet"))
    assert got == data.load_dataset(str(tmp_path / "d.jsonl"))
    assert got[0] == {"prompt": "1+1", "answer": "2", "level": 1, "messages": [{"role": "user", "content": "1+1"}]}
    assert got[1]["messages"][0] == {"role": "system", "content": "be brief"} and got[1]["answer"] == "7"
    (tmp_path / "d.csv").write_text("prompt,answer\n1+1,2\n")
    with pytest.raises(ValueError, match="unknown format '.csv'; give a .jsonl or .parquet"):
        data.load_dataset(str(tmp_path / "d.csv"))
    (tmp_path / "bad.jsonl").write_text(json.dumps(rows[0]) + "\n{oops\n")
    with pytest.raises(ValueError, match="bad.jsonl line 2 is not JSON"):
        data.load_dataset(str(tmp_path / "bad.jsonl"))


def test_import_object():
    assert data.import_object("data.exact_match") is data.exact_match
    with pytest.raises(ValueError, match="cannot load"):
        data.import_object("data.nothing_here")
