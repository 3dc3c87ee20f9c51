"""Tools for a chat template that has no place for them (the default SmolLM2's is one).

Such a template renders only ``role`` and ``content``. So the tool definitions go into the system
message (after the one the client sent, if any), with an instruction to answer in the Hermes format
that :class:`~jaxinfer.tool_parsers.hermes.HermesParser` reads; an assistant turn that called tools
is written back as those blocks, and a tool's result as a user turn holding ``<tool_response>``
blocks (consecutive results in one turn), since such templates know no ``tool`` role.
"""

from __future__ import annotations

import json

from jaxinfer.tool_parsers.hermes import CLOSE, OPEN

RESPONSE_OPEN = "<tool_response>"
RESPONSE_CLOSE = "</tool_response>"


def tools_system_prompt(tools: list[dict]) -> str:
    """The instruction and the tool definitions (OpenAI tool objects, one JSON line each)."""
    definitions = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return (
        "You can call functions to help answer the user. These are the functions, one JSON "
        f"definition a line, between <tools> and </tools>:\n<tools>\n{definitions}\n</tools>\n\n"
        "To call a function, write a JSON object with its name and its arguments between "
        f"{OPEN} and {CLOSE}, one block per call:\n"
        f'{OPEN}\n{{"name": "<function name>", "arguments": {{<arguments as JSON>}}}}\n{CLOSE}\n'
        f"The results come back between {RESPONSE_OPEN} and {RESPONSE_CLOSE}."
    )


def tool_call_text(tool_calls: list[dict]) -> str:
    """An assistant's OpenAI ``tool_calls`` written as the Hermes blocks it would have generated."""
    blocks = []
    for call in tool_calls:
        function = call["function"]
        arguments = function.get("arguments")
        arguments = json.loads(arguments) if isinstance(arguments, str) and arguments else (arguments or {})
        body = json.dumps({"name": function["name"], "arguments": arguments}, ensure_ascii=False)
        blocks.append(f"{OPEN}\n{body}\n{CLOSE}")
    return "\n".join(blocks)


def messages_for_plain_template(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """``messages`` (OpenAI's, tool fields included) rewritten for a template that renders only
    role and content; ``tools`` (None or empty: no tools offered) go into the system message."""
    out: list[dict] = []
    if tools:
        prompt = tools_system_prompt(tools)
        if messages and messages[0]["role"] == "system":
            prompt = f"{messages[0]['content']}\n\n{prompt}" if messages[0]["content"] else prompt
            messages = messages[1:]
        out.append({"role": "system", "content": prompt})
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if role == "assistant" and message.get("tool_calls"):
            calls = tool_call_text(message["tool_calls"])
            out.append({"role": "assistant", "content": f"{content}\n{calls}" if content else calls})
        elif role == "tool":
            block = f"{RESPONSE_OPEN}\n{content}\n{RESPONSE_CLOSE}"
            if out and out[-1].get("is_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "is_tool_results": True})
        else:
            out.append({"role": role, "content": content})
    return [{"role": m["role"], "content": m["content"]} for m in out]
