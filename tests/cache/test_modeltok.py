"""The model tokenizer and chat template of the read path (kvfleet/cache/modeltok.py): the shipped files are
the ones SOURCES.md names, the special-token rule of completions, what cannot be keyed and why. Equality
with vLLM's and SGLang's own code is the interop suite's (tests/interop/test_chat_tokens.py)."""

from __future__ import annotations

import gzip
import hashlib
import re
from typing import Any

import pytest

from kvfleet.cache.modeltok import (
    BUILTIN_DIR,
    ChatRequest,
    ChatTemplateError,
    ModelTokenizer,
    UnsupportedChat,
    builtin_names,
    dialect_for,
    load_model_tokenizer,
)

QWEN = load_model_tokenizer("builtin:qwen2.5")
MISTRAL = load_model_tokenizer("builtin:mistral-nemo")
TURN = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]


def test_shipped_files_are_the_ones_sources_md_names() -> None:
    sources = (BUILTIN_DIR / "SOURCES.md").read_text()
    listed = dict((path, digest) for digest, path in re.findall(r"^([0-9a-f]{64})  (\S+)$", sources, re.M))
    files = ("tokenizer.json", "tokenizer_config.json")
    assert set(listed) == {f"{m}/{f}" for m in builtin_names() for f in files}
    for path, digest in listed.items():
        model, name = path.split("/")
        f = BUILTIN_DIR / model / name
        data = f.read_bytes() if f.exists() else gzip.decompress(f.with_name(f"{name}.gz").read_bytes())
        assert hashlib.sha256(data).hexdigest() == digest, path


def test_completions_follow_the_tokenizers_special_token_rule() -> None:
    assert MISTRAL.encode_prompt("Hello")[0] == 1  # <s>: Mistral's post-processor
    assert MISTRAL.encode("Hello")[0] != 1  # chat text: the template writes BOS itself
    assert QWEN.encode_prompt("Hello").tolist() == QWEN.encode("Hello").tolist()  # Qwen adds nothing


def test_chat_renders_the_models_own_template() -> None:
    text = QWEN.render_chat(ChatRequest(TURN))
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello there<|im_end|>\n"
                    "<|im_start|>assistant\n")
    assert MISTRAL.render_chat(ChatRequest(TURN)) == "<s>[INST]Be brief.\n\nHello there[/INST]"
    ids = QWEN.encode_chat(ChatRequest(TURN)).tolist()
    assert ids[0] == 151644 and ids.count(151644) == 3  # <|im_start|> is one special token, never split


def test_dialects_differ_where_the_engines_do() -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert "a\nb" in QWEN.render_chat(ChatRequest(parts), "vllm")
    assert "a b" in QWEN.render_chat(ChatRequest(parts), "sglang")
    tool = {"type": "function", "function": {"name": "ping"}}
    assert '"description": null' in QWEN.render_chat(ChatRequest(TURN, [tool]), "vllm")
    assert '"defer_loading": null' in QWEN.render_chat(ChatRequest(TURN, [tool]), "sglang")
    old = QWEN.render_chat(ChatRequest(TURN, [tool]), "sglang-0.5.3")
    assert '{"description": null, "name": "ping"' in old
    no_gen = ChatRequest(TURN, add_generation_prompt=False)
    assert not QWEN.render_chat(no_gen, "vllm").endswith("assistant\n")
    assert QWEN.render_chat(no_gen, "sglang").endswith("assistant\n")  # SGLang always adds it
    assert dialect_for("sglang", (0, 5, 3)) == "sglang-0.5.3" and dialect_for("sglang", None) == "sglang"
    assert dialect_for("vllm", (0, 11, 0)) == dialect_for("sim") == "vllm"


@pytest.mark.parametrize(("chat", "reason"), [
    (ChatRequest([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     "content_part"),
    (ChatRequest([{"role": "user", "content": None}]), "content"),
    (ChatRequest([]), "messages"),
    (ChatRequest(TURN, continue_final_message=True), "continue_final_message"),
    (ChatRequest(TURN, chat_template_kwargs={"custom": 1}), "chat_template_kwargs"),
    (ChatRequest(TURN, [{"type": "function", "function": {"name": "f"}}], tool_choice="required"),
     "tool_choice"),
    (ChatRequest(TURN, [{"type": "function", "function": {"name": "f", "x-extra": 1}}]), "tools"),
    (ChatRequest([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}]}]),
     "tool_calls"),
])
def test_what_cannot_be_reproduced_is_refused_with_a_reason(chat: ChatRequest, reason: str) -> None:
    with pytest.raises(UnsupportedChat) as err:
        QWEN.encode_chat(chat)
    assert err.value.reason == reason


def test_unknown_roles_and_final_assistant_turns_follow_the_engines_dialect() -> None:
    """vLLM hands a message of any role to the template (Qwen's skips one it does not know); SGLang's request
    model refuses it. SGLang 0.5.23 renders a conversation that ends with an assistant turn otherwise than
    vLLM: not keyed for it (tests/interop/test_chat_tokens.py holds both to the engines' own answers)."""
    odd = ChatRequest([TURN[0], {"role": "critic", "content": "x"}, TURN[1]])
    assert QWEN.render_chat(odd, "vllm") == QWEN.render_chat(ChatRequest(TURN), "vllm")
    with pytest.raises(UnsupportedChat) as err:
        QWEN.encode_chat(odd, "sglang")
    assert err.value.reason == "role"
    history = ChatRequest([*TURN, {"role": "assistant", "content": "ok"}], add_generation_prompt=False)
    assert len(QWEN.encode_chat(history, "vllm")) and len(QWEN.encode_chat(history, "sglang-0.5.3"))
    with pytest.raises(UnsupportedChat) as err:
        QWEN.encode_chat(history, "sglang")
    assert err.value.reason == "final_assistant"


def test_a_conversation_the_template_rejects_is_a_template_error() -> None:
    """Mistral's template raises on roles that do not alternate; the engine answers 400 for it too."""
    with pytest.raises(ChatTemplateError, match="alternate"):
        MISTRAL.encode_chat(ChatRequest([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]))


def test_unknown_specs_say_what_exists(tmp_path: object) -> None:
    with pytest.raises(FileNotFoundError, match=r"qwen2\.5"):
        load_model_tokenizer("builtin:nope")
    with pytest.raises(FileNotFoundError, match="not a directory"):
        load_model_tokenizer("/nonexistent/model")


@pytest.mark.parametrize("tok", [QWEN, MISTRAL], ids=["qwen2.5", "mistral-nemo"])
def test_piecewise_encoding_equals_the_whole_encoding(tok: ModelTokenizer) -> None:
    """Reuse across turns is claimed exact: on conversations with unicode, whitespace at the cut points,
    the anchor and other special tokens typed inside messages, every encoding equals the tokenizer's own
    encoding of the whole text, and follow-up turns hit the piece cache."""
    import random

    rng = random.Random(3)
    alphabet = [*"abc xyz ÀÉ東京 \n\t  🚚.,!?", "<|im_end|>", "</s>", "<s>", "[INST]", "<|im_start|>", "  \n"]
    hits = tok.piece_hits
    for _ in range(30):
        msgs: list[dict[str, Any]] = [{"role": "system", "content": "".join(rng.choices(alphabet, k=900))}]
        for _turn in range(5):
            msgs.append({"role": "user", "content": "".join(rng.choices(alphabet, k=rng.randint(1, 400)))})
            text = tok.render_chat(ChatRequest(msgs))
            assert tok.encode(text).tolist() == tok._encode_whole(text).tolist()
            reply = "".join(rng.choices(alphabet, k=rng.randint(0, 200)))
            msgs.append({"role": "assistant", "content": reply})
    assert tok.piece_hits > hits  # the earlier turns' pieces were reused


@pytest.mark.parametrize("name", builtin_names())
@pytest.mark.parametrize("special", [True, False])
def test_the_offset_free_encoding_gives_the_plain_encodings_ids(name: str, special: bool) -> None:
    """The ids come from ``encode_batch_fast`` (no character offsets) where the release has it: the same ids
    as ``encode``, special tokens, whitespace and non-ASCII text included."""
    tok = load_model_tokenizer(f"builtin:{name}")
    assert tok._fast is not None  # the release pinned here has it: the path under test is the fast one
    texts = ["", " ", "Hello there", "héllo <|im_end|> wörld\n\n  \t", "</s><s>[INST] x [/INST]",
             "数据 " * 50 + "tail", "a" * 5000]
    for text in texts:
        assert tok._ids(text, special).tolist() == tok._tok.encode(text, add_special_tokens=special).ids
