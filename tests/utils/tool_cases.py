"""Tools, schemas and a Hermes-style chat template shared by the structured-output and
tool-calling server tests."""

from __future__ import annotations

# A tiny random model never stops emitting whitespace where JSON allows any: ask for none.
NO_WS = {"structured_outputs": {"disable_any_whitespace": True}}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
# A Hermes-style template (the tiny model's own has no tools): tools in the system turn,
# assistant tool calls as <tool_call> blocks, tool results as <tool_response>.
HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:\n{% for t in tools %}{{ t | tojson }}\n"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n"
    "{%- elif m.tool_calls %}<|im_start|>assistant\n{% for c in m.tool_calls %}<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n'
    "</tool_call>{% endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
