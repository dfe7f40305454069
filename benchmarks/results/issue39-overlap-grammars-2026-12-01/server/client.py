import asyncio
import json
import sys

from openai import AsyncOpenAI

port = int(sys.argv[1])
c = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x")
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "population": {"type": "integer"}},
    "required": ["city", "population"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


def msgs(t):
    return [{"role": "user", "content": t}]


async def one(kind, i):
    q = ["Tell me about Paris.", "What is the capital of Japan?", "Describe a cat.", "Weather in Rome?"][i % 4]
    kw = dict(model="SmolLM2-135M-Instruct", messages=msgs(q), max_tokens=48, temperature=0)
    if kind == "schema":
        kw["response_format"] = {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA, "strict": True}}
    elif kind == "regex":
        kw["extra_body"] = {"guided_regex": "[A-Z][a-z]+ (is|was) [a-z ]{5,40}\\."}
    elif kind == "tools":
        kw.update(tools=TOOLS, tool_choice="required")
    elif kind == "object":
        kw["response_format"] = {"type": "json_object"}
    elif kind == "sampled":
        kw.update(temperature=0.8, seed=7 + i)
    r = await c.chat.completions.create(**kw)
    m = r.choices[0].message
    return [
        kind,
        i,
        m.content,
        [(t.function.name, t.function.arguments) for t in (m.tool_calls or [])],
        r.choices[0].finish_reason,
        r.usage.completion_tokens,
    ]


async def main():
    kinds = ["schema", "regex", "plain", "tools", "object", "sampled", "plain", "plain"]
    out = await asyncio.gather(*(one(k, i) for i in range(3) for k in kinds))
    print(json.dumps(out, indent=0))


asyncio.run(main())
