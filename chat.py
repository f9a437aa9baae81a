"""Chat formats of model families: their templates, special tokens, end tokens, tool-call and reasoning parsers.

A chat model is trained on one format: how turns are laid out, which token ends a turn, how the model writes a tool
call and its thinking. LoongSage reads all of that from the model's tokenizer (its chat template, special tokens,
eos) and generation config (every end token), and parses what the model writes with the parser of its family,
named as SGLang 0.5.23 names them (`--tool-call-parser`, `--reasoning-parser`):

    tool_parser       hermes | qwen25 (alias qwen) | llama3 | mistral | deepseekv3
    reasoning_parser  qwen3 | deepseek-r1

Each tool parser is a plain function, `parse_<name>(text, tools) -> (content, tool_calls)` with `tools` the
request's OpenAI tool list; the reasoning parsers are `parse_reasoning(name, text) -> (reasoning, content)`. They
follow SGLang's detectors (`sglang/srt/function_call/*_detector.py`, `detect_and_parse`;
`sglang/srt/parser/reasoning_parser.py`) on the same text, and depart from them only where the router needs a call
it can hand to both APIs:
* arguments must be a JSON object (or a string holding one); anything else makes the whole text plain content with
  no calls, as SGLang does when a block fails to parse;
* a call gets an id of its family's shape: Mistral's templates take 9 alphanumeric characters (and the model writes
  the id it was shown, which is kept), the others `call_` + 24 hex digits as SGLang gives.
Like SGLang, a call naming a tool the request did not offer is dropped.

`ChatFormat` (last) is what the router renders and parses with (the template, every end token, the control tokens
dropped before parsing, the forced-call grammar), and `TurnStream` a streamed reply's deltas. `pick_tool_parser` /
`pick_reasoning_parser` choose a parser where the template shows one format only. The tiny tokenizers
(data.build_tiny_tokenizer) are built from `FAMILIES`, each with a template here in the family's published format.

Test: `.venv/bin/python -m pytest tests/test_chat.py` (parsers on each family's text, templates against the
published layouts, TITO per family through the router, the official clients). Imports nothing heavy at its top
(transformers only when a ChatFormat is built; no sglang), so a conformance test can run it beside SGLang's parsers.
Left out: streaming (incremental) parsing; pythonic, XML (qwen3_coder) and harmony tool formats; Mistral's
compact `[TOOL_CALLS]name[ARGS]{...}` tokens as special tokens of a tiny tokenizer (the parser reads that form).
"""
from __future__ import annotations

import ast
import contextlib
import functools
import json
import logging
import re
import secrets
import string
import uuid
from pathlib import Path

from wire import ApiError, Turn

log = logging.getLogger("loongsage.chat")

TOOL_PARSERS = ("hermes", "qwen25", "qwen", "llama3", "mistral", "deepseekv3")
REASONING_PARSERS = ("qwen3", "deepseek-r1")


# ----------------------------------------------------------------------------------------------
# templates of the tiny tokenizers, one per family. Rendered by transformers (trim_blocks, lstrip_blocks); every
# tag strips the whitespace around it, so layout here is for reading only. Each was checked against its source.

# The tiny recipes' compact ChatML (Qwen2.5 layout, a short tool preamble: the tiny model's prompts stay short).
# Qwen's turn layout: <|im_start|>role\n...<|im_end|>\n; tools listed in the system turn; calls as
# <tool_call>\n{json}\n</tool_call>; tool results back as a user turn of <tool_response> blocks.
CHATML_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\nCall a tool with <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>. Tools:"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}<|im_end|>\n"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'user' %}<|im_start|>user\n{{ message.content }}<|im_end|>\n"
    "{% elif message.role == 'assistant' %}<|im_start|>assistant\n"
    "{% if message.content %}{{ message.content }}{% endif %}"
    "{% if message.tool_calls %}{% for tc in message.tool_calls %}"
    "{% set fn = tc.function if tc.function is defined else tc %}"
    "{% if message.content or not loop.first %}{{ '\\n' }}{% endif %}"
    "<tool_call>\n{\"name\": \"{{ fn.name }}\", \"arguments\": "
    "{% if fn.arguments is string %}{{ fn.arguments }}{% else %}{{ fn.arguments | tojson }}{% endif %}"
    "}\n</tool_call>{% endfor %}{% endif %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ message.content }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Qwen3 with thinking, as Qwen3-8B's tokenizer_config.json chat template and SGLang's Qwen25Detector /
# Qwen3Detector lay it out:
# * tools: the system turn "# Tools ... <tools>\n{tool json per line}\n</tools> ... <tool_call> ...";
# * an assistant turn: <think>\n{reasoning}\n</think>\n\n{content}, then each call on its own line as
#   <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>, then <|im_end|>\n;
# * thinking is rendered only for assistant turns after the last real user query (a user turn that is not just
#   <tool_response> blocks), and there only when the turn has some or is the last message (which gets an empty
#   <think>\n\n</think>\n\n block): earlier turns' thinking is dropped from the prompt;
# * `enable_thinking=false` (a chat_template_kwargs key) ends the generation prompt with an empty think block.
QWEN3_TEMPLATE = r"""
{%- if tools %}
  {{- '<|im_start|>system\n' }}
  {%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
  {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n" }}
  {{- "You are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
  {%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
  {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
      "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
      "<args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- elif messages[0].role == 'system' %}
  {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
  {%- set index = (messages|length - 1) - loop.index0 %}
  {%- if ns.multi_step_tool and message.role == 'user' and message.content is string
        and not (message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
    {%- set ns.multi_step_tool = false %}
    {%- set ns.last_query_index = index %}
  {%- endif %}
{%- endfor %}
{%- for message in messages %}
  {%- set content = message.content if message.content is string else '' %}
  {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
    {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>\n' }}
  {%- elif message.role == 'assistant' %}
    {%- set reasoning = '' %}
    {%- if message.reasoning_content is string %}
      {%- set reasoning = message.reasoning_content %}
    {%- elif '</think>' in content %}
      {%- set reasoning = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
      {%- set content = content.split('</think>')[-1].lstrip('\n') %}
    {%- endif %}
    {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning) %}
      {{- '<|im_start|>assistant\n<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
    {%- else %}
      {{- '<|im_start|>assistant\n' + content }}
    {%- endif %}
    {%- for tc in message.tool_calls or [] %}
      {%- if content or not loop.first %}{{- '\n' }}{%- endif %}
      {%- set fn = tc.function if tc.function else tc %}
      {{- '<tool_call>\n{"name": "' + fn.name + '", "arguments": ' }}
      {{- fn.arguments if fn.arguments is string else (fn.arguments | tojson) }}
      {{- '}\n</tool_call>' }}
    {%- endfor %}
    {{- '<|im_end|>\n' }}
  {%- elif message.role == 'tool' %}
    {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
    {{- '\n<tool_response>\n' + content + '\n</tool_response>' }}
    {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
  {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
  {{- '<|im_start|>assistant\n' }}
  {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}
{%- endif %}
"""

# The same, except that every assistant turn keeps its thinking: a conversation then only ever grows, so a
# multi-turn trajectory stays one segment (chat_template: chat.QWEN3_KEEP_THINKING_TEMPLATE). The model is then
# trained on prompts its own template would not show it; the choice is the user's (docs/AGENTFLOW.md).
QWEN3_KEEP_THINKING_TEMPLATE = QWEN3_TEMPLATE.replace(
    "{%- if loop.index0 > ns.last_query_index and (loop.last or reasoning) %}", "{%- if true %}")

# Llama 3.1 / 3.2 with JSON tool calls, as Meta-Llama-3.1-8B-Instruct's chat template, its model card's "JSON based
# tool calling" and SGLang's Llama32Detector lay it out:
# * <|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n, "Environment: ipython\n" when tools are given,
#   the knowledge and today dates (fixed: "26 Jul 2024", the template's default), the system message, <|eot_id|>;
# * tools go into the first user turn: the instruction, each tool as JSON indented by 4, then that user's text;
# * a tool call is the assistant turn {"name": ..., "parameters": {...}}<|eot_id|> (one call per turn);
# * a tool result is an ipython turn; its content goes through tojson, so a string result arrives quoted (the
#   published template's `is iterable` test is true for strings too: kept as published);
# * every turn's text is trimmed; the generation prompt is the assistant header.
LLAMA3_TEMPLATE = r"""
{{- bos_token }}
{%- set date_string = date_string if date_string is defined else '26 Jul 2024' %}
{%- if messages[0].role == 'system' %}
  {%- set system_message = messages[0].content | trim %}
  {%- set messages = messages[1:] %}
{%- else %}
  {%- set system_message = '' %}
{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\n\n' }}
{%- if tools %}{{- 'Environment: ipython\n' }}{%- endif %}
{{- 'Cutting Knowledge Date: December 2023\nToday Date: ' + date_string + '\n\n' }}
{{- system_message + '<|eot_id|>' }}
{%- if tools %}
  {%- if not messages %}{{- raise_exception('tools go into the first user message, and there is none') }}{%- endif %}
  {{- '<|start_header_id|>user<|end_header_id|>\n\n' }}
  {{- 'Given the following functions, please respond with a JSON for a function call with its proper arguments '
      'that best answers the given prompt.\n\n' }}
  {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.'
      'Do not use variables.\n\n' }}
  {%- for tool in tools %}{{- (tool | tojson(indent=4)) + '\n\n' }}{%- endfor %}
  {{- (messages[0].content | trim) + '<|eot_id|>' }}
  {%- set messages = messages[1:] %}
{%- endif %}
{%- for message in messages %}
  {%- if message.role == 'tool' or message.role == 'ipython' %}
    {{- '<|start_header_id|>ipython<|end_header_id|>\n\n' }}
    {{- (message.content | tojson) if (message.content is mapping or message.content is iterable)
        else message.content }}
    {{- '<|eot_id|>' }}
  {%- elif message.tool_calls %}
    {%- if message.tool_calls | length != 1 %}{{- raise_exception('Llama 3 makes one tool call per turn') }}{%- endif %}
    {%- set fn = message.tool_calls[0].function %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "' + fn.name + '", "parameters": ' }}
    {{- (fn.arguments | tojson) + '}<|eot_id|>' }}
  {%- else %}
    {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\n\n' + (message.content | trim) + '<|eot_id|>' }}
  {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}
"""

# Mistral v0.3 (Mistral-7B-Instruct-v0.3's chat template, the reference of SGLang's MistralDetector). It
# renders: <s>; [AVAILABLE_TOOLS] [{"type": "function", "function": {...}}, ...][/AVAILABLE_TOOLS] just before
# the LAST user message; [INST] {user}[/INST]; the system message only when a user message is the last message,
# as "[INST] {system}\n\n{user}[/INST]"; an answer as " {content}</s>"; tool calls as
# [TOOL_CALLS] [{"name": ..., "arguments": {...}, "id": "<9 chars>"}, ...]</s> (the content of such a turn is
# not rendered); a result as [TOOL_RESULTS] {"content": {result}, "call_id": "<9 chars>"}[/TOOL_RESULTS]. No
# generation prompt: the model answers right after [/INST] or [/TOOL_RESULTS]. Tool call ids must be 9
# characters long, and user/assistant turns must alternate (as published).
MISTRAL_TEMPLATE = r"""
{%- if messages[0].role == 'system' %}
  {%- set system_message = messages[0].content %}
  {%- set loop_messages = messages[1:] %}
{%- else %}
  {%- set loop_messages = messages %}
{%- endif %}
{%- set user_messages = loop_messages | selectattr('role', 'equalto', 'user') | list %}
{%- set ns = namespace(index=0) %}
{%- for message in loop_messages %}
  {%- if not (message.role == 'tool' or message.tool_calls) %}
    {%- if (message.role == 'user') != (ns.index % 2 == 0) %}
      {{- raise_exception('After the optional system message, conversation roles must alternate '
                          'user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- set ns.index = ns.index + 1 %}
  {%- endif %}
{%- endfor %}
{{- bos_token }}
{%- for message in loop_messages %}
  {%- if message.role == 'user' %}
    {%- if tools and message == user_messages[-1] %}
      {{- '[AVAILABLE_TOOLS] [' }}
      {%- for tool in tools %}
        {{- '{"type": "function", "function": {' }}
        {%- for key, val in tool.function.items() if key != 'return' %}
          {{- '"' + key + '": ' + (('"' + val + '"') if val is string else (val | tojson)) }}
          {%- if not loop.last %}{{- ', ' }}{%- endif %}
        {%- endfor %}
        {{- '}}' + (', ' if not loop.last else ']') }}
      {%- endfor %}
      {{- '[/AVAILABLE_TOOLS]' }}
    {%- endif %}
    {%- if loop.last and system_message is defined %}
      {{- '[INST] ' + system_message + '\n\n' + message.content + '[/INST]' }}
    {%- else %}
      {{- '[INST] ' + message.content + '[/INST]' }}
    {%- endif %}
  {%- elif message.tool_calls %}
    {{- '[TOOL_CALLS] [' }}
    {%- for tc in message.tool_calls %}
      {%- if tc.id is not defined or tc.id | length != 9 %}
        {{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}
      {%- endif %}
      {{- (tc.function | tojson)[:-1] + ', "id": "' + tc.id + '"}' + (', ' if not loop.last else ']' + eos_token) }}
    {%- endfor %}
  {%- elif message.role == 'assistant' %}
    {{- ' ' + (message.content | trim) + eos_token }}
  {%- elif message.role == 'tool' %}
    {%- if message.tool_call_id is not defined or message.tool_call_id | length != 9 %}
      {{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}
    {%- endif %}
    {{- '[TOOL_RESULTS] {"content": ' + (message.content | string) + ', "call_id": "' + message.tool_call_id
        + '"}[/TOOL_RESULTS]' }}
  {%- else %}
    {{- raise_exception('Only user and assistant roles are supported, with the exception of an initial optional '
                        'system message!') }}
  {%- endif %}
{%- endfor %}
"""

# DeepSeek-V3. Turns as DeepSeek-V3-0324's chat template lays them out, tools in the system prompt as SGLang's
# tool_chat_template_deepseekv3.jinja writes them. It renders: <｜begin▁of▁sentence｜>{system};
# <｜User｜>{user}<｜Assistant｜>; an answer as
# {content}<｜end▁of▁sentence｜>; calls as {content}<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>
# {name}\n```json\n{arguments}\n```<｜tool▁call▁end｜> (several joined by \n), then
# <｜tool▁calls▁end｜><｜end▁of▁sentence｜>; results as <｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>{result}
# <｜tool▁output▁end｜> (several joined by \n) and <｜tool▁outputs▁end｜>, after which the model answers with no
# header. Arguments are rendered as JSON for every call (the SGLang example renders the first call's with tojson
# and concatenates the others' as strings, which fails on an object).
DEEPSEEK_V3_TEMPLATE = r"""
{%- set ns = namespace(is_first=false, is_tool=false, is_output_first=true, system_prompt='', is_first_sp=true,
                       is_last_user=false) %}
{%- for message in messages if message.role == 'system' %}
  {%- set ns.system_prompt = ns.system_prompt + ('' if loop.first else '\n\n') + message.content %}
{%- endfor %}
{%- if tools %}
  {%- set tns = namespace(text='You are a helpful assistant with tool calling capabilities. When a tool call is '
                 'needed, you MUST use the following format to issue the call:\n<｜tool▁calls▁begin｜>'
                 '<｜tool▁call▁begin｜>function<｜tool▁sep｜>FUNCTION_NAME\n```json\n{"param1": "value1", "param2": '
                 '"value2"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>\n\nMake sure the JSON is valid.## Tools\n\n'
                 '### Function\n\nYou have the following functions available:\n\n') %}
  {%- for tool in tools %}{%- set tns.text = tns.text + '\n```json\n' + (tool | tojson) + '\n```\n' %}{%- endfor %}
  {%- set ns.system_prompt = ns.system_prompt + '\n\n' + tns.text %}
{%- endif %}
{{- bos_token + ns.system_prompt }}
{%- for message in messages %}
  {%- if message.role == 'user' %}
    {%- set ns.is_tool = false %}{%- set ns.is_first = false %}{%- set ns.is_last_user = true %}
    {{- '<｜User｜>' + message.content + '<｜Assistant｜>' }}
  {%- elif message.role == 'assistant' and message.tool_calls %}
    {%- set ns.is_last_user = false %}
    {%- if ns.is_tool %}{{- '<｜tool▁outputs▁end｜>' }}{%- endif %}
    {%- set ns.is_tool = false %}{%- set ns.is_output_first = true %}
    {{- message.content or '' }}
    {%- for tc in message.tool_calls %}
      {{- ('<｜tool▁calls▁begin｜>' if loop.first else '\n') + '<｜tool▁call▁begin｜>' + tc.type + '<｜tool▁sep｜>'
          + tc.function.name + '\n```json\n' }}
      {{- (tc.function.arguments if tc.function.arguments is string else (tc.function.arguments | tojson))
          + '\n```<｜tool▁call▁end｜>' }}
    {%- endfor %}
    {{- '<｜tool▁calls▁end｜><｜end▁of▁sentence｜>' }}
  {%- elif message.role == 'assistant' %}
    {%- set ns.is_last_user = false %}
    {%- if ns.is_tool %}{{- '<｜tool▁outputs▁end｜>' }}{%- set ns.is_tool = false %}{%- endif %}
    {{- message.content + '<｜end▁of▁sentence｜>' }}
  {%- elif message.role == 'tool' %}
    {%- set ns.is_last_user = false %}{%- set ns.is_tool = true %}
    {%- if ns.is_output_first %}
      {{- 'Use the results below to formulate an answer to the user question unless additional information is '
          'needed.<｜tool▁outputs▁begin｜>' }}
      {%- set ns.is_output_first = false %}
    {%- else %}
      {{- '\n' }}
    {%- endif %}
    {{- '<｜tool▁output▁begin｜>' + message.content + '<｜tool▁output▁end｜>' }}
  {%- endif %}
{%- endfor %}
{%- if ns.is_tool %}{{- '<｜tool▁outputs▁end｜>' }}{%- endif %}
{%- if add_generation_prompt and not ns.is_last_user and not ns.is_tool %}{{- '<｜Assistant｜>' }}{%- endif %}
"""

# A function tool as the tiny tasks offer it: the tiny tokenizers' corpus holds its JSON in each family's layout.
_TOOL_JSON = {"type": "function", "function": {"name": "calculator", "description": "evaluate an arithmetic expression",
                                               "parameters": {"type": "object", "properties": {
                                                   "expression": {"type": "string"}}, "required": ["expression"]}}}
_DS_TOOL_TOKENS = ["<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                   "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>",
                   "<｜tool▁output▁end｜>"]

# Qwen's tokens, the ChatML and Qwen3 families' both (Qwen3's generation_config.json eos_token_id: [151645
# <|im_end|>, 151643 <|endoftext|>])
_QWEN_TOKENS = dict(special=["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>",
                             "<tool_response>", "</tool_response>", "<think>", "</think>"],
                    bos=None, eos="<|im_end|>", pad="<|endoftext|>", stop=["<|im_end|>", "<|endoftext|>"])
# The tiny tokenizers' families: special tokens (the first takes id 0), bos/eos/pad, the end tokens the published
# generation_config.json lists, the chat template, and text the BPE is trained on so the template's prose is cheap.
FAMILIES = {
    "chatml": dict(**_QWEN_TOKENS, template=CHATML_TEMPLATE, corpus=[]),
    "qwen3": dict(**_QWEN_TOKENS, template=QWEN3_TEMPLATE,
                  corpus=["# Tools You may call one or more functions to assist with the user query.",
                          "You are provided with function signatures within <tools></tools> XML tags:",
                          "For each function call, return a json object with function name and arguments within",
                          '{"name": <function-name>, "arguments": <args-json-object>}']),
    # Llama 3.1 Instruct: generation_config.json eos_token_id [128001 <|end_of_text|>, 128008 <|eom_id|>,
    # 128009 <|eot_id|>]; tokenizer eos <|eot_id|>
    "llama3": dict(special=["<|finetune_right_pad_id|>", "<|begin_of_text|>", "<|end_of_text|>",
                            "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
                            "<|python_tag|>"],
                   bos="<|begin_of_text|>", eos="<|eot_id|>", pad="<|finetune_right_pad_id|>",
                   stop=["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"], template=LLAMA3_TEMPLATE,
                   corpus=["Environment: ipython", "Cutting Knowledge Date: December 2023", "Today Date: 26 Jul 2024",
                           "Given the following functions, please respond with a JSON for a function call with its "
                           "proper arguments that best answers the given prompt.",
                           'Respond in the format {"name": function name, "parameters": dictionary of argument name '
                           'and its value}.Do not use variables.', json.dumps(_TOOL_JSON, indent=4),
                           '{"name": "calculator", "parameters": {"expression": "1+2"}}']),
    # Mistral-7B-Instruct-v0.3: generation_config.json eos_token_id 2 (</s>); no pad token
    "mistral": dict(special=["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                             "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"],
                    bos="<s>", eos="</s>", pad=None, stop=["</s>"], template=MISTRAL_TEMPLATE,
                    corpus=['{"type": "function", "function": {"name": "calculator", "description":',
                            '[{"name": "calculator", "arguments": {"expression": "1+2"}, "id": "a1b2c3d4e"}]',
                            '{"content": 3, "call_id": "a1b2c3d4e"}']),
    # DeepSeek-V3: generation_config.json eos_token_id 1 (<｜end▁of▁sentence｜>), bos 0; pad = eos
    "deepseek_v3": dict(special=["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
                                 *_DS_TOOL_TOKENS, "<think>", "</think>"],
                        bos="<｜begin▁of▁sentence｜>", eos="<｜end▁of▁sentence｜>", pad="<｜end▁of▁sentence｜>",
                        stop=["<｜end▁of▁sentence｜>"], template=DEEPSEEK_V3_TEMPLATE,
                        corpus=["You are a helpful assistant with tool calling capabilities. When a tool call is "
                                "needed, you MUST use the following format to issue the call:",
                                "Make sure the JSON is valid.## Tools ### Function You have the following functions "
                                "available:", "```json", "function",
                                "Use the results below to formulate an answer to the user question unless "
                                "additional information is needed."]),
}

# Special tokens a parser reads: kept in the text it parses (every other special token is a control token the
# router drops from what the model wrote).
MARKERS = {"hermes": ("<tool_call>", "</tool_call>"), "qwen25": ("<tool_call>", "</tool_call>"),
           "qwen": ("<tool_call>", "</tool_call>"), "llama3": ("<|python_tag|>",),
           "mistral": ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"), "deepseekv3": tuple(_DS_TOOL_TOKENS[:5]),
           "qwen3": ("<think>", "</think>"), "deepseek-r1": ("<think>", "</think>")}


# ----------------------------------------------------------------------------------------------
# picking a parser from the template, and the end tokens


def pick_tool_parser(template: str) -> str:
    """The tool parser a chat template's syntax shows, or "" where it shows none or several."""
    seen = [name for name, marks in (("deepseekv3", ("<｜tool▁calls▁begin｜>",)), ("mistral", ("[TOOL_CALLS]",)),
                                     ("llama3", ("<|python_tag|>", "<|start_header_id|>ipython")),
                                     ("hermes", ("<tool_call>",)))
            if any(m in (template or "") for m in marks)]
    return seen[0] if len(seen) == 1 else ""


def pick_reasoning_parser(template: str, generation_prompt: str) -> str:
    """"deepseek-r1" where the generation prompt itself opens the thinking (the model never writes <think>),
    "qwen3" where the template knows </think> (the model opens and closes it), else ""."""
    if generation_prompt.rstrip().endswith("<think>"):
        return "deepseek-r1"
    return "qwen3" if "</think>" in (template or "") else ""


def end_token_ids(tok, model_dir: str | None = None) -> list[int]:
    """Every token that ends a generation: the tokenizer's eos and each eos_token_id of the model's
    generation_config.json and config.json (an int or a list: Llama 3.1 lists <|end_of_text|>, <|eom_id|> and
    <|eot_id|>; Qwen3 <|im_end|> and <|endoftext|>)."""
    ids = {tok.eos_token_id} if tok.eos_token_id is not None else set()
    for name in ("generation_config.json", "config.json"):
        path = Path(model_dir or "") / name
        if model_dir and path.exists():
            eos = json.loads(path.read_text()).get("eos_token_id")
            ids.update([eos] if isinstance(eos, int) else (eos or []))
    if not ids:
        raise ValueError(f"the tokenizer of {model_dir} has no eos token and its configs list no eos_token_id; a "
                         "chat model needs one to end its turns")
    return sorted(ids)


def assistant_suffix(render) -> str:
    """What a template writes after an assistant message's content ("<|im_end|>\\n" for Qwen, "<|eot_id|>" for
    Llama 3). `render(messages) -> str` renders without a generation prompt."""
    mark = "\x00MARK\x00"
    probe = render([{"role": "user", "content": "x"}, {"role": "assistant", "content": mark}])
    return probe[probe.rindex(mark) + len(mark):]


def turn_end(suffix: str, special_tokens) -> str:
    """The token a template closes an assistant turn with: the special token its assistant suffix starts with."""
    hits = [t for t in special_tokens if t and suffix.startswith(t)]
    if not hits:
        raise ValueError(f"the chat template closes an assistant turn with {suffix!r}, which starts with none of the "
                         "tokenizer's special tokens; cannot tell where the model's turn ends")
    return max(hits, key=len)


def reply_text(render, messages: list[dict], reply: dict, end: str) -> tuple[str, str]:
    """(prompt, reply text): the generation prompt of `messages`, and the text the template writes for the assistant
    message `reply` after it, up to and including the end-of-turn token `end`: exactly what the model must write
    (SFT targets). `render(messages, add_generation_prompt) -> str`."""
    prompt, full = render(messages, True), render(messages + [reply], False)
    if not full.startswith(prompt):
        raise ValueError("the chat template renders the reply's turn differently from its generation prompt; "
                         f"prompt ends {prompt[-80:]!r}, the rendered turn {full[len(prompt) - 80:][:160]!r}")
    body = full[len(prompt):]
    if end not in body:
        raise ValueError(f"the chat template ends an assistant turn without the end token {end!r}: {body[-80:]!r}")
    return prompt, body[:body.rindex(end) + len(end)]


# ----------------------------------------------------------------------------------------------
# tool-call parsers: (text, tools) -> (content, tool_calls), each call {"id", "type": "function",
# "function": {"name", "arguments": dict}}


class _NotACall(ValueError):
    """A tool-call block that is not one the router can hand on: the whole text stays content."""


def _call_id(style: str = "openai", written=None) -> str:
    if style == "mistral":  # Mistral's templates take 9 alphanumeric characters; keep the one the model wrote
        if isinstance(written, str) and len(written) == 9 and written.isalnum():
            return written
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
    return "call_" + uuid.uuid4().hex[:24]


def _calls(actions, tools, style: str = "openai") -> list[dict]:
    """Call objects ({"name", "arguments" | "parameters"}) -> tool calls, as SGLang's parse_base_json reads them:
    "parameters" first when truthy, then "arguments"; a call of a tool not offered is dropped. Where it departs
    (arguments must be an object, or a JSON string of one): the module docstring."""
    names = {t["function"]["name"] for t in tools or ()}
    out = []
    for act in actions if isinstance(actions, list) else [actions]:
        if not isinstance(act, dict):
            raise _NotACall(f"a call must be an object, got {act!r:.80}")
        name = act.get("name")
        if not (isinstance(name, str) and name in names):
            continue
        args = act.get("parameters") or act.get("arguments", {})
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                raise _NotACall(f"arguments {args!r:.80} are not JSON") from None
        if not isinstance(args, dict):
            raise _NotACall(f"arguments must be a JSON object, got {args!r:.80}")
        out.append({"id": _call_id(style, act.get("id")), "type": "function",
                    "function": {"name": name, "arguments": args}})
    return out


_HERMES_RE = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)


def parse_hermes(text: str, tools) -> tuple[str, list[dict]]:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, whitespace inside free; an unclosed last
    block counts. Content: the text before the first block. (SGLang HermesDetector)"""
    idx = text.find("<tool_call>")
    if idx == -1:
        return text, []
    try:
        calls = []
        for raw in filter(None, _HERMES_RE.findall(text)):  # the last block may be unclosed
            calls += _calls(json.loads(raw.strip()), tools)
        return text[:idx].strip(), calls
    except (ValueError, AttributeError):  # bad JSON or a block that is no call: all of it is content
        return text, []


_QWEN25_RE = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.DOTALL)


def parse_qwen25(text: str, tools) -> tuple[str, list[dict]]:
    """`<tool_call>\\n{json}\\n</tool_call>` blocks (Qwen2.5 / Qwen3); a block that is not JSON is skipped.
    Content: the text before the first block. (SGLang Qwen25Detector, parser names qwen25 and qwen)"""
    idx = text.find("<tool_call>\n")
    if idx == -1:
        return text, []
    calls = []
    for raw in _QWEN25_RE.findall(text):
        try:
            calls += _calls(json.loads(raw.strip()), tools)
        except json.JSONDecodeError:
            continue
        except _NotACall:
            return text, []
    return text[:idx].strip(), calls


def parse_llama3(text: str, tools) -> tuple[str, list[dict]]:
    """Llama 3.x JSON calls: text that starts with `{`, or follows <|python_tag|>, holds call objects
    `{"name": ..., "parameters": {...}}` separated by `;` (a Python dict literal is read too). Content: the text
    before <|python_tag|> and whatever follows the last object. (SGLang Llama32Detector, parser name llama3)"""
    tag = "<|python_tag|>"
    if tag not in text and not text.startswith("{"):
        return text, []
    normal, action = text.split(tag, 1) if tag in text else ("", text)
    decoder, idx, safe, found = json.JSONDecoder(), 0, 0, []
    while 0 <= idx < len(action):
        with contextlib.suppress(json.JSONDecodeError):
            obj, end = decoder.raw_decode(action[idx:])
            found.append(obj)
            idx = safe = idx + end + 1  # past the object and its ";" separator
            continue
        close = _brace_end(action, idx)
        if close > idx:  # a Python dict literal ({'name': ...}) as Llama models sometimes write
            with contextlib.suppress(ValueError, SyntaxError, MemoryError, RecursionError, TypeError):
                obj = ast.literal_eval(action[idx:close].strip())
                if isinstance(obj, dict):
                    found.append(obj)
                    idx = safe = close + 1
                    continue
        idx = action.find('{"name":', idx + 1)  # the next call object; -1: none, the loop ends
    try:
        calls = _calls(found, tools) if found else []
    except _NotACall:
        return text, []
    return normal + (action[safe:].strip() if safe < len(action) else ""), calls


def _brace_end(text: str, start: int) -> int:
    """The index after the first `}` that brings the brace count from `start` back to 0 (SGLang's count: strings
    not skipped), or `start`."""
    depth = 0
    for m in re.finditer("[{}]", text[start:]):
        depth += 1 if m.group() == "{" else -1
        if depth == 0 and m.group() == "}":
            return start + m.end()
    return start


def _json_span(text: str, start: int) -> int:
    """The index after the JSON object or array opening at `start` (brackets counted outside strings), or -1."""
    if start >= len(text) or text[start] not in "{[":
        return -1
    opening = text[start]
    closing = "}" if opening == "{" else "]"
    depth, in_string = 0, False
    for m in re.finditer(r'\\.|["{}\[\]]', text[start:], re.DOTALL):  # an escaped character: skipped
        if m.group() == '"':
            in_string = not in_string
        elif not in_string and m.group() == opening:
            depth += 1
        elif not in_string and m.group() == closing:
            depth -= 1
            if depth == 0:
                return start + m.end()
    return -1


def parse_mistral(text: str, tools) -> tuple[str, list[dict]]:
    """Mistral calls: `[TOOL_CALLS] [{"name": ..., "arguments": {...}, "id": ...}, ...]` (v0.3), or the compact
    `[TOOL_CALLS]name[ARGS]{...}` of newer templates, repeated. Content: the text before [TOOL_CALLS] and after the
    calls. Ids are the model's own where it wrote 9 alphanumeric characters. (SGLang MistralDetector)"""
    marker = text.find("[TOOL_CALLS")
    if marker == -1:
        return text, []
    normal, part = text[:marker].strip(), text[marker:]
    if "[TOOL_CALLS] [" in part:
        start = part.find("[TOOL_CALLS] [") + len("[TOOL_CALLS] ")
        end = _json_span(part, start)
        if end == -1:
            return normal, []
        try:
            calls = _calls(json.loads(part[start:end]), tools, style="mistral")  # an array of calls, or one
        except json.JSONDecodeError:
            calls = []
        except _NotACall:
            return text, []
        trailing = part[end:].strip()
        return (normal + " " + trailing).strip() if trailing else normal, calls
    calls, rest = [], part
    while rest:
        found = _mistral_compact(rest)
        if found is None:
            break
        name, args, used = found
        try:
            calls += _calls({"name": name, "arguments": args}, tools, style="mistral")
        except _NotACall:
            return text, []
        rest = rest[used:].strip()
    if not calls:
        return normal, []
    return (normal + " " + rest).strip() if rest else normal, calls


def _mistral_compact(text: str):
    """(name, arguments, end index) of a `[TOOL_CALLS]name[ARGS]{...}` call at the start of `text`, or None."""
    m = re.search(r"\[TOOL_CALLS\]?(.*?)\[ARGS\]?\s*", text, re.DOTALL)  # either tag's "]" may be missing
    name = m.group(1).strip() if m else ""
    end = _json_span(text, m.end()) if name else -1
    if end == -1:
        return None
    try:
        return name, json.loads(text[m.end():end]), end
    except json.JSONDecodeError:
        return None


_DS_CALL_RE = re.compile(r"<｜tool▁call▁begin｜>.*?<｜tool▁call▁end｜>", re.DOTALL)
_DS_DETAIL_RE = re.compile(r"<｜tool▁call▁begin｜>(.*)<｜tool▁sep｜>(.*)\n```json\n(.*)\n```<｜tool▁call▁end｜>", re.DOTALL)


def parse_deepseekv3(text: str, tools) -> tuple[str, list[dict]]:
    """DeepSeek-V3 calls: <｜tool▁calls▁begin｜> then per call <｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}
    \\n```json\\n{arguments}\\n```<｜tool▁call▁end｜>. Content: the text before <｜tool▁calls▁begin｜>.
    (SGLang DeepSeekV3Detector, parser name deepseekv3)"""
    idx = text.find("<｜tool▁calls▁begin｜>")
    if idx == -1:
        return text, []
    try:
        calls = []
        for block in _DS_CALL_RE.findall(text):
            m = _DS_DETAIL_RE.search(block)
            if m is None:
                raise _NotACall(f"not a DeepSeek-V3 call: {block!r:.80}")
            calls += _calls({"name": m.group(2), "parameters": json.loads(m.group(3))}, tools)
        return text[:idx].strip(), calls
    except ValueError:
        return text, []


def parse_tool_calls(parser: str, text: str, tools) -> tuple[str, list[dict]]:
    """Dispatch on the parser's name (TOOL_PARSERS)."""
    parse = {"hermes": parse_hermes, "qwen25": parse_qwen25, "qwen": parse_qwen25, "llama3": parse_llama3,
             "mistral": parse_mistral, "deepseekv3": parse_deepseekv3}.get(parser)
    if parse is None:
        raise ValueError(f"tool_parser {parser!r} is not one of {TOOL_PARSERS} (or a dotted path to your own)")
    return parse(text, tools)


# ----------------------------------------------------------------------------------------------
# reasoning parsers: text -> (reasoning, content). "" reasoning: the model did not think.


def parse_reasoning(parser: str, text: str) -> tuple[str, str]:
    """SGLang's BaseReasoningFormatDetector.detect_and_parse for `parser` (REASONING_PARSERS). qwen3 (SGLang
    Qwen3Detector): the model writes <think>...</think> itself, or not at all (enable_thinking=false). deepseek-r1
    (SGLang DeepSeekR1Detector): the generation prompt opens the thinking, so everything up to </think> is thinking,
    with or without a <think> the model repeats. Leading <think> tags are stripped; thinking ends at the first
    </think>. Unclosed: all of it is thinking (the turn was cut), except where qwen3's meets a <tool_call>."""
    if parser not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser {parser!r} is not one of {REASONING_PARSERS}")
    if parser == "qwen3" and "<think>" not in text:
        return "", text
    text = re.sub(r"^(?:<think>)+", "", text)  # leading <think> tags, however many
    if "</think>" not in text:
        cut = text.find("<tool_call>") if parser == "qwen3" else -1
        return (text[:cut], text[cut:]) if cut != -1 else (text, "")
    return tuple(text.split("</think>", 1))


# ----------------------------------------------------------------------------------------------
# the chat format: the tokenizer, its template, end tokens and the parsers above, as the router uses them


class ChatFormat:
    """The tokenizer + chat template, the model family's parsers (py), and the few token facts TITO needs.

    End tokens: the tokenizer's eos and every eos_token_id of the model's generation config (all of them: Llama 3's
    <|eot_id|>, <|eom_id|> and <|end_of_text|>), plus the token the template closes an assistant turn with. Control
    tokens: the tokenizer's special tokens, less those the parsers read (<tool_call>, <think>, [TOOL_CALLS], ...):
    dropped from what the model wrote before it is parsed."""

    def __init__(self, tokenizer_path: str, chat_template: str = "", tool_parser="", reasoning_parser: str = "",
                 template_kwargs: dict | None = None):
        """`chat_template`: a Jinja template string ("" = the tokenizer's). `tool_parser`: an SGLang parser name
        (TOOL_PARSERS), a function `fn(text, tools) -> (content, tool_calls)`, "none", or "" to pick the one the
        template shows. `reasoning_parser`: qwen3, deepseek-r1, "none", or "" to pick from the template.
        `template_kwargs`: variables every render gets (a request's chat_template_kwargs override them). The cfg keys
        of the same names, whose dotted paths AgentFlow resolves."""
        from transformers import AutoTokenizer  # late: importing chat.py stays cheap (data.load_tokenizer's note)
        self.tok = AutoTokenizer.from_pretrained(tokenizer_path)
        self.template = chat_template or None  # None: the tokenizer's
        self.template_kwargs = dict(template_kwargs or {})
        source = self.template or self.tok.chat_template or ""
        self.user_parser = tool_parser if callable(tool_parser) else None
        tool_parser = getattr(tool_parser, "__name__", "user") if callable(tool_parser) else tool_parser
        self.tool_parser = tool_parser if tool_parser not in ("", "none") else (
            pick_tool_parser(source) if tool_parser == "" else "")
        if self.user_parser is None and self.tool_parser and self.tool_parser not in TOOL_PARSERS:
            raise ValueError(f"tool_parser={tool_parser!r}: choose one of {TOOL_PARSERS}, 'none', a dotted "
                             "path to fn(text, tools) -> (content, tool_calls), or '' to pick from the chat template")
        generation_prompt = self.render([{"role": "user", "content": "x"}], add_generation_prompt=True)
        self.reasoning_parser = reasoning_parser if reasoning_parser not in ("", "none") else (
            pick_reasoning_parser(source, generation_prompt) if reasoning_parser == "" else "")
        if self.reasoning_parser and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser={reasoning_parser!r}: choose one of {REASONING_PARSERS}, "
                             "'none', or '' to pick from the chat template")
        # the variable that switches thinking on and off in the template (Qwen3's enable_thinking), if it has one
        self.thinking_switch = "enable_thinking" if "enable_thinking" in source else ""
        self.vocab_size = len(self.tok)
        # What the template writes after an assistant message's content (ChatML: its end token and a newline). The
        # model's own tokens end the content with the turn's end token (its first token); the rest closes the turn.
        self.assistant_suffix = assistant_suffix(self.render)
        try:
            self.eos_text = turn_end(self.assistant_suffix, self.tok.all_special_tokens)
        except ValueError:  # a template that writes text of its own first ("]<end>"): the model ends with its eos
            self.eos_text = self.tok.eos_token
        self.eos_id = self.tok.convert_tokens_to_ids(self.eos_text)
        self.stop_ids = sorted(set(end_token_ids(self.tok, tokenizer_path)) | {self.eos_id})
        specials = {i: t.content for i, t in self.tok.added_tokens_decoder.items() if t.special}
        if self.user_parser is not None:  # it sees every special token the model wrote but the turn's end and padding
            self._control = frozenset(self.stop_ids) | {i for i in (self.tok.bos_token_id, self.tok.pad_token_id)
                                                        if i is not None}
        else:
            read = set(MARKERS.get(self.tool_parser, ())) | set(MARKERS.get(self.reasoning_parser, ()))
            self._control = frozenset(i for i, t in specials.items() if t not in read)
        self._think_end = self.tok.convert_tokens_to_ids("</think>") if "</think>" in specials.values() else None
        # close_turn_ids' two answers, tokenized once rather than per turn
        after_eos = self.assistant_suffix[len(self.eos_text):] if self.assistant_suffix.startswith(self.eos_text) \
            else self.assistant_suffix
        self._close_ids = {True: self.encode(after_eos), False: self.encode(self.assistant_suffix)}
        self._prompts: dict[str, list[int]] = {}  # prompt_ids' cache: JSON of (messages, tools, kwargs) -> ids
        self._syntax: dict[str, tuple] = {}  # call_syntax's cache: JSON of (tools, kwargs) -> its parts

    def prompt_ids(self, messages: list[dict], tools: list[dict] | None = None,
                   kwargs: dict | None = None) -> list[int]:
        """The ids of a chat rendered with the generation prompt, cached by content (a pure function of messages,
        tools and kwargs): the N samples of a group render the same first prompt, and the Jinja render is the
        largest per-trajectory cost of a step (docs/AGENTFLOW.md)."""
        key = json.dumps([messages, tools, kwargs], sort_keys=True, default=str)
        if key not in self._prompts:
            if len(self._prompts) >= 4096:  # a bound, not an LRU: the next groups' prompts refill it
                self._prompts.clear()
            self._prompts[key] = self.encode(self.render(messages, tools, add_generation_prompt=True, kwargs=kwargs))
        return list(self._prompts[key])

    def render(self, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = False,
               kwargs: dict | None = None) -> str:
        return self.tok.apply_chat_template(messages, tools=tools or None, tokenize=False, chat_template=self.template,
                                            add_generation_prompt=add_generation_prompt,
                                            **{**self.template_kwargs, **(kwargs or {})})

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False) if text else []

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def assistant_text(self, output_ids: list[int]) -> str:
        """Model output as text for parsing: the tokens the parsers read kept, control tokens dropped."""
        return self.decode([i for i in output_ids if i not in self._control], skip_special_tokens=False)

    def parse(self, text: str, tools: list[dict] | None, parse_tools: bool = True,
              separate_reasoning: bool = True) -> tuple[str, str, list[dict]]:
        """(reasoning, content, tool_calls) of an assistant text: the thinking split off first, then the tool calls
        parsed from the rest, as SGLang orders them. With `separate_reasoning` False the thinking stays in the
        content (SGLang's request field of that name)."""
        reasoning = ""
        if self.reasoning_parser and separate_reasoning:
            reasoning, text = parse_reasoning(self.reasoning_parser, text)
        calls = []
        if parse_tools and tools:
            if self.user_parser is not None:
                text, calls = self.user_parser(text, tools)
            elif self.tool_parser:
                text, calls = parse_tool_calls(self.tool_parser, text, tools)
        return reasoning.strip(), text.strip(), calls

    def settled(self, output_ids: list[int], tools: list[dict] | None, parse_tools: bool = True,
                separate_reasoning: bool = True, stop: list[str] | None = None) -> tuple[str, str]:
        """(reasoning, content) of a turn still being generated that no later token can change: prefixes of what
        `parse` gives for the whole turn (after the router's stop strings), whatever the model writes next. Held back:
        an incomplete character, a tail that may grow into a marker (a stop string, </think>, a tool call's start),
        whitespace at either end (the parse strips it), and everything from a tool call's start on, since a call is
        parsed whole (and may turn out to be content); the content waits for the thinking to close. One departure:
        Qwen3's parse makes thinking of everything before </think> once a <think> appears anywhere, so a <think>
        written after content has been settled leaves that content sent (the stream stops settling; see TurnStream)."""
        text = self.assistant_text(output_ids).rstrip("\ufffd")
        if stop:
            text = _before(text, stop)
        reasoning, content = "", text
        if self.reasoning_parser and separate_reasoning:
            forced = self.reasoning_parser == "deepseek-r1"
            if forced or "<think>" in text:
                text = re.sub(r"^(?:<think>)+", "", text)
                if text and "<think>".startswith(text):
                    return "", ""
                if "</think>" not in text:  # still thinking (Qwen3's ends at a tool call if it never closes)
                    return _before(text, ["</think>"] + ([] if forced else ["<tool_call>"])).strip(), ""
                reasoning, content = text.split("</think>", 1)
            else:
                content = _before(text, ["<think>"])
        if parse_tools and tools and self.user_parser is not None:
            content = ""  # the user's parser reads the whole turn
        elif parse_tools and tools and self.tool_parser:
            if self.tool_parser == "llama3" and content.startswith("{"):
                content = ""  # Llama 3 may write a call as the whole reply
            content = _before(content, [TOOL_CALL_STARTS[self.tool_parser]])
        return reasoning.strip(), content.strip()

    def reasoning_tokens(self, output_ids: list[int], reasoning: str) -> int:
        """How many of the output tokens are thinking: through </think>, or all of them when it never closed."""
        if not reasoning:
            return 0
        if self._think_end is not None and self._think_end in output_ids:
            return output_ids.index(self._think_end) + 1
        return len(output_ids)

    def with_thinking(self, req, field: str, value) -> dict:
        """A request's chat_template_kwargs with its thinking (`req.thinking`, from the request's `field`: an Anthropic
        `thinking`, a Responses `reasoning` or a Chat Completions `reasoning_effort`, `value` as sent) set as the
        template's switch, on or off (SGLang's mapping). Thinking asked of a model without a reasoning parser, turned
        off where the template cannot, or set differently by chat_template_kwargs is refused rather than ignored."""
        enabled, thinking = req.thinking, {}
        if enabled and not self.reasoning_parser:
            raise ApiError(400, f"thinking was requested ({field}), but this model has no reasoning parser "
                           "(cfg.reasoning_parser; its chat template shows no <think>...</think> format)", param=field)
        if enabled is not None and self.thinking_switch:
            thinking = {self.thinking_switch: enabled}
        elif enabled is False and self.reasoning_parser:
            raise ApiError(400, f"thinking is always on for this model (reasoning_parser {self.reasoning_parser!r}); "
                           f"its chat template has no switch to turn it off ({field})", param=field)
        clash = {k for k in thinking if k in req.template_kwargs and req.template_kwargs[k] != thinking[k]}
        if clash:
            raise ApiError(400, f"{field} {value!r:.100} and chat_template_kwargs set {sorted(clash)} differently; "
                           "send one of them", param=field)
        return {**req.template_kwargs, **thinking}

    def check_structured(self, req, template_kwargs: dict) -> None:
        """Refuse structured output (a grammar from `text.format` / `response_format`) where it and the template
        disagree: the grammar holds from the reply's first token, so offered tools could never be called, and a
        thinking model could not think (`refuse_thinking`)."""
        if req.structured is None:
            return
        if req.tools and req.parse_tools:
            raise ApiError(400, f"{req.structured} (structured output) cannot be combined with tools: the grammar "
                           "holds from the first token, so the chat template's tool-call syntax could never be "
                           "written; send tool_choice 'none' or leave out the tools", param=req.structured)
        self.refuse_thinking(template_kwargs, f"{req.structured} (structured output)", req.structured)

    def refuse_thinking(self, template_kwargs: dict, what: str, param: str) -> None:
        """Refuse `what` (structured output, a forced tool call) unless the request's template variables turn thinking
        off: its grammar holds from the reply's first token, where a thinking model thinks (SGLang with a reasoning
        parser lets the thinking run free before the grammar starts: the two engines would sample differently)."""
        switch, merged = self.thinking_switch, {**self.template_kwargs, **template_kwargs}
        if self.reasoning_parser and not (switch and merged.get(switch) is False):
            how = (f"reasoning_effort / reasoning.effort 'none', thinking disabled, or chat_template_kwargs "
                   f"{{'{switch}': false}}" if switch else "nothing: it always thinks")
            raise ApiError(400, f"{what} on a thinking model (reasoning_parser {self.reasoning_parser!r}) needs "
                           f"thinking off: the grammar holds from the first token, where the model thinks; turn it "
                           f"off with {how}", param=param)

    def call_syntax(self, tools: list[dict], kwargs: dict) -> tuple[str, str, str, str | None]:
        """How this template writes an assistant turn of tool calls, learnt by rendering one: (before, between, after,
        separator). A reply of calls c1..cn is `before NAME1 between ARGS1 (separator NAME2 between ARGS2)* after`,
        up to the turn's end token; the separator is None where the template takes one call per turn (Llama 3).
        A tool-call id the template writes (Mistral's) appears in the parts as "\x00ID\x00"."""
        key = json.dumps([tools, kwargs], sort_keys=True, default=str)
        if key in self._syntax:
            return self._syntax[key]
        msgs, ids, names = [{"role": "user", "content": "x"}], ("zqid00001", "zqid00002"), ("zqname1", "zqname2")
        args = [re.compile(r'\{\s*"zqarg"\s*:\s*%d\s*\}' % i) for i in (1, 2)]

        def body(n: int) -> str:
            reply = {"role": "assistant", "content": "", "tool_calls": [
                {"id": ids[i], "type": "function", "function": {"name": names[i], "arguments": {"zqarg": i + 1}}}
                for i in range(n)]}
            render = functools.partial(self.render, tools=tools, kwargs=kwargs)
            _, text = reply_text(lambda m, gen: render(m, add_generation_prompt=gen), msgs, reply, self.eos_text)
            return text[:-len(self.eos_text)].replace(ids[0], "\x00ID\x00").replace(ids[1], "\x00ID\x00")

        one = body(1)
        name, arg = one.find(names[0]), args[0].search(one)
        if name == -1 or arg is None or arg.start() < name:
            raise ApiError(400, f"tool_choice: cannot tell how this chat template writes a tool call (its rendering "
                           f"of one call: {one!r:.200}); send tool_choice 'auto'", param="tool_choice")
        before, between, after = one[:name], one[name + len(names[0]):arg.start()], one[arg.end():]
        separator = None
        try:
            two = body(2)
        except Exception:  # a template that takes one call per turn raises (Llama 3's does)
            two = ""
        first, second = args[0].search(two), args[1].search(two)
        if first and second:
            sep = two[first.end():two.find(names[1])]
            if two == before + names[0] + between + first.group() + sep + names[1] + between + second.group() + after:
                separator = sep
        if len(self._syntax) >= 256:  # a bound, as prompt_ids' cache has: agents whose tools vary refill it
            self._syntax.clear()
        self._syntax[key] = before, between, after, separator
        return self._syntax[key]

    def tool_grammar(self, req, template_kwargs: dict) -> dict:
        """The sampling parameter that holds a reply's tool calls (SGLang's `structural_tag`, which both engines
        compile with xgrammar), written in this template's own call syntax (`call_syntax`) so the sampled tokens are
        those the template renders for the calls and the next turn extends them; {} when the request needs none.

        * tool_choice "required" or a named tool (`req.forced`: the names it may call): the reply is one or more
          calls (one with `req.parallel_calls` off). Refused where the model would be made to skip its thinking
          (the grammar holds from the first token), and where no parser of the router's reads the calls.
        * tool_choice "auto" with a `strict` tool: the reply is free, and a call, once the model starts one, holds
          to its tool's schema (SGLang constrains "auto" with a strict tool the same way). Only where each call is a
          block of its own that starts with the parser's marker (Hermes / Qwen's <tool_call>): a template that wraps
          all calls in one block (DeepSeek's, Mistral's) or has no marker (Llama 3's) gets its calls parsed only.

        A strict tool's arguments follow its JSON schema (a custom tool's input is a string), others any object."""
        names = {t["function"]["name"] for t in req.tools or ()}
        if not req.parse_tools or not (req.forced or req.strict & names):
            return {}
        if self.user_parser is not None or not self.tool_parser:
            if not req.forced:
                return {}  # no parser of the router's reads the calls: nothing to hold them to
            has = "its own" if self.user_parser else "none"
            raise ApiError(400, "tool_choice: forcing a tool call needs one of the router's tool parsers "
                           f"({', '.join(TOOL_PARSERS)}); this model has {has}; send tool_choice 'auto'",
                           param="tool_choice")
        if req.forced:
            choice = "required" if len(req.forced) > 1 else repr(req.forced[0])
            self.refuse_thinking(template_kwargs, f"tool_choice {choice}", "tool_choice")
        before, between, after, separator = self.call_syntax(req.tools, template_kwargs)

        def schema(f: dict) -> dict:
            return {"type": "json_schema", "json_schema": f["parameters"] if f["name"] in req.strict else
                    {"type": "object"}}
        if not req.forced:
            trigger = TOOL_CALL_STARTS[self.tool_parser]
            if "\x00ID\x00" in before + between + after or not before.startswith(trigger) or separator is None \
                    or not (separator.startswith(after) and separator.endswith(before)):
                return {}
            tags = [{"type": "tag", "begin": before + t["function"]["name"] + between, "content": schema(t["function"]),
                     "end": after} for t in req.tools]
            return {"structural_tag": json.dumps({"type": "structural_tag", "format": {
                "type": "triggered_tags", "triggers": [trigger], "tags": tags,
                "stop_after_first": not req.parallel_calls}})}

        def text(value: str) -> list[dict]:  # a part of the syntax; a tool-call id the template writes: 9 characters
            out = []
            for i, piece in enumerate(value.split("\x00ID\x00")):
                if i:
                    out.append({"type": "regex", "pattern": "[A-Za-z0-9]{9}"})
                if piece:
                    out.append({"type": "const_string", "value": piece})
            return out
        calls = [{"type": "sequence", "elements": [*text(t["function"]["name"] + between), schema(t["function"])]}
                 for t in req.tools if t["function"]["name"] in req.forced]
        call = calls[0] if len(calls) == 1 else {"type": "or", "elements": calls}
        more = [{"type": "star", "content": {"type": "sequence", "elements": [*text(separator), call]}}] \
            if separator is not None and req.parallel_calls else []
        tag = {"type": "structural_tag", "format": {"type": "sequence",
                                                     "elements": [*text(before), call, *more, *text(after)]}}
        return {"structural_tag": json.dumps(tag)}

    def close_turn_ids(self, output_ids: list[int]) -> list[int]:
        """Template tokens that close an assistant turn after the model's own tokens (loss_mask 0).

        The model normally ends with the turn's end token, which is the suffix's first token; then only the rest
        ("\\n" for Qwen) is added. A turn cut by max_tokens, or ended by another end token (Llama 3's
        <|end_of_text|>), gets the whole suffix. The model's ids stay as sampled.
        """
        return list(self._close_ids[bool(output_ids) and output_ids[-1] == self.eos_id])


# Where each tool parser's call syntax starts (py's parsers): a streamed reply holds back the text from there on.
TOOL_CALL_STARTS = {"hermes": "<tool_call>", "qwen25": "<tool_call>", "qwen": "<tool_call>", "llama3": "<|python_tag|>",
                    "mistral": "[TOOL_CALLS", "deepseekv3": "<｜tool▁calls▁begin｜>"}


def _before(text: str, marks: list[str]) -> str:
    """`text` up to the first of `marks` it holds, and short of a tail that may be the start of one."""
    cut = len(text)
    for mark in filter(None, marks):
        i = text.find(mark)
        if i == -1:  # not in it: hold back the longest tail of text that the mark starts with
            tails = [k for k in range(1, min(len(mark), len(text) + 1)) if text.endswith(mark[:k])]
            i = len(text) - max(tails, default=0)
        cut = min(cut, i)
    return text[:cut]


class TurnStream:
    """The reasoning and content deltas of a turn as its tokens arrive, for a streamed reply: each update sends what
    `ChatFormat.settled` adds to what was sent, and `finish` the rest of the parsed Turn, so the deltas add up to the
    plain reply's reasoning and content. No reasoning goes out after content has. An engine retry starts its tokens
    again: nothing goes out until they pass what was sent."""

    def __init__(self, chat: ChatFormat, tools: list[dict] | None, parse_tools: bool, separate_reasoning: bool,
                 stop: list[str] | None):
        self.chat, self.tools, self.parse_tools = chat, tools, parse_tools
        self.separate_reasoning, self.stop = separate_reasoning, stop
        self.sent = {"reasoning": "", "content": ""}

    def _deltas(self, reasoning: str, content: str) -> list[tuple[str, str]]:
        out = []
        for kind, now in (("reasoning", reasoning), ("content", content)):
            sent = self.sent[kind]
            if len(now) > len(sent) and now.startswith(sent) and not (kind == "reasoning" and self.sent["content"]):
                out.append((kind, now[len(sent):]))
                self.sent[kind] = now
        return out

    def update(self, output_ids: list[int]) -> list[tuple[str, str]]:
        return self._deltas(*self.chat.settled(output_ids, self.tools, self.parse_tools, self.separate_reasoning,
                                               self.stop))

    def finish(self, turn: Turn) -> list[tuple[str, str]]:
        out = self._deltas(turn.reasoning, turn.content)
        if self.sent != {"reasoning": turn.reasoning, "content": turn.content}:
            log.warning("a streamed reply's deltas do not add up to its turn (sent %r, parsed %r); the trajectory "
                        "holds the parsed turn", self.sent, (turn.reasoning, turn.content))
        return out
