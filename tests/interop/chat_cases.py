"""Requests whose prompt token ids the EPP must compute exactly as the engines do
(tests/interop/test_chat_tokens.py): completions, multi-turn chat with a system prompt, text parts, tools,
tool calls and their results. Plain data."""

from __future__ import annotations

from typing import Any

SYSTEM = "You are a careful assistant for a logistics company. Answer in two sentences at most."
DOC = ("Shipment 4471 left Rotterdam on 3 March carrying 212 pallets of ceramic tiles; the customs broker "
       "flagged two pallets for inspection because their declared weight differed by more than 5 % from "
       "the scale reading. ") * 3
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"},
                                                    "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city"]}}}
BARE = {"type": "function", "function": {"name": "ping"}}
CALL = {"id": "call12345", "type": "function",
        "function": {"name": "get_weather", "arguments": "{\"city\": \"Lyon\", \"unit\": \"c\"}"}}

TURN1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": DOC + "Where did it leave from?"}]
TURN2 = [*TURN1, {"role": "assistant", "content": "It left Rotterdam on 3 March."},
         {"role": "user", "content": "How many pallets were flagged, and why?"}]
TOOLS = [{"role": "user", "content": "What's the weather in Lyon?"},
         {"role": "assistant", "content": None, "tool_calls": [CALL]},
         {"role": "tool", "tool_call_id": "call12345", "content": "{\"temp\": 14, \"sky\": \"cloudy\"}"},
         {"role": "assistant", "content": "14 °C and cloudy."},
         {"role": "user", "content": "And tomorrow?"}]

#: id → request body (``model`` is added by the caller)
CASES: dict[str, dict[str, Any]] = {
    "completion": {"prompt": "The quick brown fox jumps over the lazy dog. " * 4},
    "completion-list": {"prompt": ["Übersetze: naïve café, 東京タワー, emoji 🚚 and tabs\tend"]},
    "chat-turn1": {"messages": TURN1},
    "chat-turn2": {"messages": TURN2},
    "chat-no-system": {"messages": TURN2[1:]},
    "chat-text-parts": {"messages": [TURN1[0], {"role": "user", "content": [
        {"type": "text", "text": DOC}, {"type": "text", "text": "Summarise."}]}]},
    "chat-tools": {"messages": TURN1, "tools": [WEATHER, BARE]},
    "chat-tool-calls": {"messages": TOOLS, "tools": [WEATHER]},
    "chat-no-generation-prompt": {"messages": TURN2, "add_generation_prompt": False},
}
CASES["chat-tool-choice-none"] = {"messages": TURN1, "tools": [WEATHER], "tool_choice": "none"}

#: Requests at the edge of what an engine takes (unknown roles, messages without content, non-text parts, odd
#: field types): whatever the engine answers, the EPP and the simulator must answer the same way (its ids
#: when it takes them; never a key when it refuses them).
EDGES: dict[str, dict[str, Any]] = {
    "edge-unknown-role": {"messages": [{"role": "narrator", "content": "It was a dark night."}, TURN1[1]]},
    "edge-no-content": {"messages": [TURN1[0], {"role": "user"}]},
    "edge-null-content": {"messages": [TURN1[0], {"role": "user", "content": None}]},
    "edge-empty-messages": {"messages": []},
    "edge-assistant-last": {"messages": TURN2[:-1]},
    "edge-image-part": {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is in it?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}]},
    "edge-unknown-part": {"messages": [{"role": "user", "content": [{"type": "video", "video": "x"}]}]},
    "edge-content-number": {"messages": [{"role": "user", "content": 42}]},
    "edge-empty-prompt": {"prompt": ""},
    "edge-tool-without-id": {"messages": [*TOOLS[:2], {"role": "tool", "content": "{}"}], "tools": [WEATHER]},
}
