"""Black-box programs that run `verifiers` environments, unmodified, against a LoongSage router session.

They run in .venv-verifiers (scripts/verifiers_env.sh), never in LoongSage's venv, and import nothing of LoongSage:
the router is only the OpenAI endpoint in $OPENAI_BASE_URL / $OPENAI_API_KEY, handed to verifiers the way its users
configure it (a `vf.ClientConfig`, so verifiers builds its own AsyncOpenAI client and sends its own requests). Each
reads its LoongSage sample from $LOONGSAGE_SAMPLE_FILE, runs one rollout through the environment's own
`generate()` (its dataset rows, parser, rubric and turn loop) and prints one JSON line: the rubric's `reward`, the
parsed `answer`, the rollout's `error` and the number of model turns.

  python tests/verifiers_agents.py rg    # vf.ReasoningGymEnv: its own dataset construction, XMLParser and rubric
  python tests/verifiers_agents.py tool  # vf.ToolEnv on a calculator task defined here (a multi-turn tool loop)

Used by tests/test_verifiers.py; by hand, against `python agentflow.py --engine URL --tokenizer DIR`'s session:
  OPENAI_BASE_URL=... OPENAI_API_KEY=... LOONGSAGE_SAMPLE_FILE=sample.json .venv-verifiers/bin/python -P ... rg
(-P: this directory's agents.py must not shadow openai-agents' `agents` package, which verifiers imports).
"""
import asyncio
import json
import os
import sys

import verifiers as vf
from datasets import Dataset
from openai import OpenAI


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression of integers with + - * and parentheses.

    Args:
        expression: the expression, e.g. (12+3)*4
    """
    if not expression or not set(expression) <= set("0123456789+-*() "):
        return f"error: {expression!r} may hold only digits, + - * ( ) and spaces"
    return str(eval(expression))  # noqa: S307  (only digits, operators and parentheses reach it)


def tool_env(sample: dict) -> tuple[vf.Environment, dict]:
    """The test's own task: compute the sample's expression with the calculator tool; 1.0 when the final reply,
    as verifiers' Parser reads it, is the answer."""
    parser = vf.Parser()

    def correct(completion, answer, **kwargs) -> float:
        return float((parser.parse_answer(completion) or "").strip() == answer)

    question = sample["messages"][-1]["content"]
    rows = Dataset.from_list([{"question": question, "answer": str(sample["answer"])}])
    env = vf.ToolEnv(tools=[calculator], max_turns=int(sample.get("max_turns", 3)), dataset=rows,
                     system_prompt="Use the calculator tool, then reply with the number only.",
                     rubric=vf.Rubric(funcs=[correct], parser=parser), parser=parser)
    return env, env.get_dataset()[0]


def rg_env(sample: dict) -> tuple[vf.Environment, dict]:
    """verifiers' ReasoningGymEnv as it builds itself: its gym, seed and train split, item `index` of the split."""
    spec = sample["verifiers"]
    env = vf.ReasoningGymEnv(gym=spec["gym"], num_train_examples=spec["index"] + 1, num_eval_examples=1,
                             seed=spec["seed"])
    return env, env.get_dataset()[spec["index"]]


async def main(kind: str) -> int:
    sample = json.loads(open(os.environ["LOONGSAGE_SAMPLE_FILE"]).read())
    env, row = {"rg": rg_env, "tool": tool_env}[kind](sample)
    model = OpenAI(max_retries=0).models.list().data[0].id  # what the endpoint serves, as any client asks
    client = vf.ClientConfig(api_base_url=os.environ["OPENAI_BASE_URL"], api_key_var="OPENAI_API_KEY", max_retries=0)
    sampling = {"max_tokens": int(sample.get("max_tokens", 8)), "temperature": 1.0}
    out = (await env.generate([row], client=client, model=model, sampling_args=sampling,
                              on_progress=lambda *a, **k: None))["outputs"][0]
    completion = out.get("completion") or []
    print(json.dumps({"reward": out["reward"], "answer": env.parser.parse_answer(completion),
                      "error": out.get("error"), "model_turns": sum(m.get("role") == "assistant" for m in completion),
                      "metrics": out.get("metrics")}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1])))
