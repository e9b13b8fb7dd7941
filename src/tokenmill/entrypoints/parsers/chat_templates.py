"""Chat templates tokenmill supplies when a model's own cannot render tool conversations.

Many small chat models (SmolLM2, the bundled default, among them) ship a
template that ignores ``tools`` and fails on an assistant turn whose
``content`` is null, so a tool loop (call, result, answer) cannot run on
them. For a template family we recognise, the server keeps the model's own
template for plain conversations (prompts stay byte-identical to
``transformers``) and renders conversations that carry tools, tool calls or
tool results with a template of the same family that writes them in the
format a tool-call parser reads (``--tool-call-parser``). ``--chat-template``
replaces both.
"""
from __future__ import annotations

from dataclasses import dataclass

# ChatML turns (<|im_start|>role ... <|im_end|>) with tools in the Hermes format
# (as Qwen2.5 and Hermes models write them): the tool list in the system turn,
# calls as <tool_call> JSON blocks, results as <tool_response> blocks in a user turn
# (consecutive results share one turn).
CHATML_HERMES_TOOLS = """
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- if not loop.first %}<|im_start|>system
{{ message.content }}<|im_end|>
{% endif %}
{%- elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{% if message.content %}{{ message.content }}
{% endif %}{% for call in message.tool_calls %}<tool_call>
{"name": {{ call.function.name | tojson }}, "arguments": {% if call.function.arguments is string %}{{ call.function.arguments }}{% else %}{{ call.function.arguments | tojson }}{% endif %}}
</tool_call>{% if not loop.last %}
{% endif %}{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user
{% endif %}<tool_response>
{{ message.content }}
</tool_response>
{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>
{% endif %}
{%- else %}<|im_start|>{{ message.role }}
{{ message.content if message.content is not none else '' }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}
"""


@dataclass(frozen=True)
class ToolsTemplate:
    """A template for tool conversations, the family it serves and the parser that reads it."""

    source: str
    family: str
    parser: str


def renders_tools(template: str) -> bool:
    """Whether a template reads the request's ``tools`` at all."""
    return "tools" in template


def tools_template_for(template: str | None) -> ToolsTemplate | None:
    """The tools template tokenmill supplies for ``template``'s family, or None when the
    template renders tools itself or its family is not one we know."""
    if template is None or renders_tools(template):
        return None
    if "<|im_start|>" in template:
        return ToolsTemplate(CHATML_HERMES_TOOLS, "ChatML", "hermes")
    return None


def parser_for(template: str | None) -> str:
    """The ``--tool-call-parser`` that reads what ``template`` teaches the model to write."""
    text = template or ""
    if "[TOOL_CALLS]" in text:
        return "mistral"
    if "<|python_tag|>" in text or "<|eom_id|>" in text:
        return "llama3_json"
    return "hermes"
