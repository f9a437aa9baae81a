#!/usr/bin/env python
"""A black-box agent: a standalone program that knows nothing of LoongSage.

It uses only the official `openai` package, configured the standard way (OPENAI_BASE_URL and
OPENAI_API_KEY from the environment; the model from OPENAI_MODEL, else the server's model list), reads its
task from argv (or stdin when no argument is given), asks the model for an answer, asks it once more to
check that answer (unless AGENT_SELF_CHECK=0), and prints the final answer.
LoongSage runs it in a sandbox with those variables pointing at a per-trajectory session of its router,
so any agent program that speaks the OpenAI (or Anthropic) API can be trained the same way.

Try it by hand against any OpenAI-compatible server:
  OPENAI_BASE_URL=http://localhost:8000/v1 OPENAI_API_KEY=x python recipes/blackbox_agent.py "12+7"
In a recipe: `agent_command: python $LOONGSAGE_ROOT/recipes/blackbox_agent.py`.
"""
import os
import sys

from openai import OpenAI


def main() -> int:
    task = " ".join(sys.argv[1:]).strip() or sys.stdin.read().strip()
    if not task:
        print("usage: blackbox_agent.py TASK (or the task on stdin)", file=sys.stderr)
        return 2
    client = OpenAI(max_retries=0)  # OPENAI_BASE_URL / OPENAI_API_KEY come from the environment
    model = os.environ.get("OPENAI_MODEL") or client.models.list().data[0].id  # a variable saves a round trip
    max_tokens = int(os.environ.get("AGENT_MAX_TOKENS", "16"))
    self_check = os.environ.get("AGENT_SELF_CHECK", "1") != "0"  # ask the model to check its answer once
    messages = [{"role": "user", "content": task}]
    answer = ""
    for prompt in (None, "Check your answer. Reply with the final answer only.")[:2 if self_check else 1]:
        if prompt:
            messages.append({"role": "user", "content": prompt})
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens)
        answer = reply.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": answer})
    print(answer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
