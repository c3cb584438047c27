"""The EPP computes a request's prompt token ids exactly as the pool's engine does, with the model's own
tokenizer files and chat template: checked against vLLM's and SGLang's own serving code.

For each tested release (vLLM 0.11.0 and 0.33.0, SGLang 0.5.3 and 0.5.23) and each built-in model (Qwen2.5:
ChatML with tools, no BOS; Mistral NeMo: ``[INST]`` with tools, BOS on completions), the requests of
``chat_cases.py`` (completions as a string and a one-element list; multi-turn chat with a system prompt,
follow-up turns, text parts, tools, tool calls and results, ``add_generation_prompt: false``, ``tool_choice:
"none"``) go through the engine's OpenAI layer in its interop venv (tests/interop/chat_tokens.py: vLLM 0.33's
GPU-less render server, vLLM 0.11's serving classes, SGLang's ``_convert_to_internal_request``), and through
the EPP's own path (``parse_request``, then :class:`PoolTokenizers` for a pool declaring the model and the
engine's dialect). The ids must be equal for every case.

Then end to end with vLLM 0.33's own KV-event publisher, for both pool hash algorithms: vLLM publishes the
blocks of the first turn's conversation (its own token ids), kvfleet's subscriber indexes them, and the
EPP's router, keying the follow-up turn with the pool's tokenizer, predicts every full block of it cached.
"""

from __future__ import annotations

import gzip
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from kvfleet.cache.hashing import BlockHasher
from kvfleet.cache.modeltok import BUILTIN_DIR, dialect_for, load_model_tokenizer
from kvfleet.config import load
from kvfleet.engine.requests import ApiError, chat_ids, prompt_ids
from kvfleet.epp.datastore import Pool, PoolCache, StaticDatastore
from kvfleet.epp.errors import EppError
from kvfleet.epp.index import BlockIndex
from kvfleet.epp.podmetrics import MetricsStore
from kvfleet.epp.protocol import CHAT, COMPLETIONS, parse_request
from kvfleet.epp.router import Router
from kvfleet.epp.subscriber import EventSubscriber
from kvfleet.epp.tokenize import PoolTokenizers
from kvfleet.operator.engines import SGLANG_TESTED, VLLM_TESTED
from tests.conftest import wait_for
from tests.interop.chat_cases import CASES, EDGES, TURN2
from tests.interop.conftest import HERE, engine_python, held, join, release
from tests.interop.test_vllm_events import VllmPublisher

#: model → (its config.json: a 2-layer stand-in, no weights; tool-call parser for vLLM, for SGLang)
MODELS: dict[str, tuple[dict[str, Any], str, str]] = {
    "qwen2.5": ({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 151936,
                 "bos_token_id": 151643, "eos_token_id": 151645, "tie_word_embeddings": True},
                "hermes", "qwen25"),
    "mistral-nemo": ({"architectures": ["MistralForCausalLM"], "model_type": "mistral", "vocab_size": 131072,
                      "head_dim": 16, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False},
                     "mistral", "mistral"),
}
SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
         "num_hidden_layers": 2, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
         "rope_theta": 1000000.0, "torch_dtype": "bfloat16"}
RELEASES = ([("vllm", ".".join(map(str, v))) for v in VLLM_TESTED]
            + [("sglang", ".".join(map(str, v))) for v in SGLANG_TESTED])
HISTORY = "chat-turn2-history"  # the first turn's conversation as the engine caches it: prompt and reply
BS = 16


def model_dir(root: Path, model: str) -> Path:
    """The built-in tokenizer files, uncompressed, beside a small config (what ``vllm serve DIR`` reads)."""
    d = root / model
    if not (d / "config.json").exists():
        d.mkdir(parents=True)
        for f in (BUILTIN_DIR / model).iterdir():
            data = f.read_bytes()
            if f.suffix == ".gz":
                (d / f.stem).write_bytes(gzip.decompress(data))
            elif f.suffix == ".json":
                (d / f.name).write_bytes(data)
        (d / "config.json").write_text(json.dumps({**SMALL, **MODELS[model][0]}))
    return d


_RESULTS: dict[tuple[str, str, str], dict[str, dict[str, Any]]] = {}


def engine_ids(engine: str, version: str, model: str, tmp: Path) -> dict[str, dict[str, Any]]:
    """case id → ``{"ids": [...]}`` or ``{"error": ...}`` from the engine's own code (run once per release and
    model)."""
    key = (engine, version, model)
    if key not in _RESULTS:
        cases = {**CASES, **EDGES, HISTORY: {"messages": TURN2[:-1], "add_generation_prompt": False}}
        path = tmp / f"cases-{engine}-{version}-{model}.json"
        path.write_text(json.dumps([{"id": k, "body": {"model": "m", **v}} for k, v in cases.items()]))
        parser = MODELS[model][1] if engine == "vllm" else MODELS[model][2]
        proc = subprocess.run(
            [str(engine_python(engine, version)), str(HERE / "chat_tokens.py"), engine,
             str(model_dir(tmp, model)), str(path), parser],
            capture_output=True, text=True, timeout=600,
            env={"PATH": "/usr/bin:/bin", "HOME": str(tmp), "HF_HUB_OFFLINE": "1",
                 "TRANSFORMERS_OFFLINE": "1", "VLLM_TARGET_DEVICE": "cpu", "VLLM_NO_USAGE_STATS": "1"})
        got = {r["id"]: r for r in (json.loads(line[7:]) for line in proc.stdout.splitlines()
                                    if line.startswith("RESULT "))}
        assert set(got) == set(cases), f"chat_tokens.py exited {proc.returncode}:\n{proc.stderr[-4000:]}"
        _RESULTS[key] = got
    return _RESULTS[key]


def pool_of(model: str, engine: str, version: str) -> Pool:
    return Pool(name="p", models=("m",), cache=PoolCache(
        tokenizer=f"builtin:{model}", chat_dialect=dialect_for(engine, release(version))))


def epp_ids(body: dict[str, Any], pool: Pool, tokenizers: PoolTokenizers) -> tuple[list[int] | None, str]:
    """What the EPP computes for ``body``: its own request parsing, then the pool's tokenizer."""
    path = CHAT if "messages" in body else COMPLETIONS
    req = parse_request(path, json.dumps({"model": "m", **body}).encode(), 1 << 20)
    got = tokenizers.tokens(req, pool)
    return (None if got.ids is None else got.ids.tolist()), got.reason


@pytest.fixture(scope="module")
def models_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize(("engine", "version"), RELEASES, ids=[f"{e}-{v}" for e, v in RELEASES])
def test_epp_prompt_tokens_equal_the_engines(
    engine: str, version: str, model: str, models_root: Path,
) -> None:
    results = engine_ids(engine, version, model, models_root)
    tokenizers = PoolTokenizers()
    pool = pool_of(model, engine, version)
    tok = tokenizers.get(f"builtin:{model}")
    for case, body in CASES.items():
        r = results[case]
        assert "error" not in r, f"{engine} {version} refused {case}: {r['error']}"
        ids, reason = epp_ids(body, pool, tokenizers)
        assert ids is not None, f"{case}: the EPP could not key it ({reason})"
        if ids != r["ids"]:
            dec = tok.decode  # type: ignore[union-attr]
            pytest.fail(f"{engine} {version} {model} {case}: token ids differ\n"
                        f" EPP:    {dec(ids)!r}\n engine: {dec(r['ids'])!r}")
        assert not body.get("prompt") or len(ids) > 10


def sim_ids(body: dict[str, Any], model: str) -> list[int] | None:
    """What the engine simulator (which stands for vLLM) computes for ``body``; None when it answers 400."""
    tok = load_model_tokenizer(f"builtin:{model}")
    try:
        ids = chat_ids(tok, body) if "messages" in body else prompt_ids(tok, body.get("prompt"))
    except ApiError:
        return None
    return [int(i) for i in ids]


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize(("engine", "version"), RELEASES, ids=[f"{e}-{v}" for e, v in RELEASES])
def test_edge_requests_get_the_engines_answer(engine: str, version: str, model: str,
                                              models_root: Path) -> None:
    """Where the engine takes an odd request, the EPP passes it on, keyed with the engine's ids or routed on
    load (counted), never refused or keyed otherwise; where the engine refuses one, the EPP never keys it (a
    400 of its own, or routed on load). The simulator, which stands for vLLM, takes and refuses what vLLM
    does, with vLLM's ids (and every regular case with them too)."""
    results = engine_ids(engine, version, model, models_root)
    tokenizers = PoolTokenizers()
    pool = pool_of(model, engine, version)
    for case, body in EDGES.items():
        r = results[case]
        try:
            ids, reason = epp_ids(body, pool, tokenizers)
        except EppError as exc:
            ids, reason = None, f"EPP {exc.status}: {exc}"
        if "error" in r:
            assert ids is None, f"{engine} {version} refuses {case} ({r['error'][:200]}) but the EPP keyed it"
        else:
            who = f"{engine} {version} takes {case}"
            assert not reason.startswith("EPP "), f"{who}; the EPP refused it: {reason}"
            assert ids is None or ids == r["ids"], f"{who}; the EPP keyed it otherwise"
    if engine == "vllm":
        for case, body in {**CASES, **EDGES}.items():
            r, ids = results[case], sim_ids(body, model)
            want = None if "error" in r else r["ids"]
            assert ids == want, (f"simulator vs vLLM {version} on {case}: "
                                 f"{'400' if ids is None else 'ids'} vs {r.get('error', 'ids')!s:.200}")


def test_completions_follow_the_bos_rule(models_root: Path) -> None:
    """Mistral's post-processor adds BOS to a completions prompt, Qwen's adds nothing; vLLM agrees."""
    version = ".".join(map(str, VLLM_TESTED[-1]))
    for model, bos in (("mistral-nemo", 1), ("qwen2.5", None)):
        ids = engine_ids("vllm", version, model, models_root)["completion"]["ids"]
        assert (ids[0] == bos) if bos is not None else ids[0] not in (151643, 151644)


@pytest.mark.parametrize("model", sorted(MODELS))
def test_follow_up_turn_predicted_fully_cached_from_vllm_events(
    model: str, algo: str, ports: tuple[int, int], subscriber: EventSubscriber, models_root: Path,
    tmp_path: Path,
) -> None:
    version = ".".join(map(str, VLLM_TESTED[-1]))
    results = engine_ids("vllm", version, model, models_root)
    history, turn2 = results[HISTORY]["ids"], results["chat-turn2"]["ids"]
    common = next((i for i, (a, b) in enumerate(zip(history, turn2, strict=False)) if a != b),
                  min(len(history), len(turn2)))
    assert common == len(history), "the template is append-only: turn 2 extends the cached conversation"

    s = load(overrides={"cache": {"block_size": BS, "hash_algo": algo}})
    pools = {"pools": [{"name": "p", "models": ["m"], "tokenizer": f"builtin:{model}", "chat_dialect": "vllm",
                        "pods": [{"name": "vllm-0", "address": "127.0.0.1", "port": 1}]}]}
    idx = BlockIndex()
    router = Router(s.epp, s.cache, StaticDatastore(data=pools), idx, MetricsStore(), PoolTokenizers())
    pub = VllmPublisher(algo, ports, tmp_path)
    try:
        join(subscriber, idx, BlockHasher(BS, algo), ports, "vllm-0")
        # vLLM's own token ids, block hashes and events
        assert pub.cmd(op="store", tokens=history)["blocks"] == len(history) // BS
        wait_for(lambda: held(idx, BlockHasher(BS, algo), history, "vllm-0") == len(history) // BS,
                 "the first turn's blocks indexed")
        req = parse_request(CHAT, json.dumps({"model": "m", "messages": TURN2}).encode(), 1 << 20)
        decision = router.route(req)
        assert decision.pod == "vllm-0" and not decision.unkeyed
        assert decision.num_tokens == len(turn2)
        # what vLLM reports cached for turn 2: every full block of the conversation it holds
        assert decision.predicted_hit_tokens == (len(history) // BS) * BS > 0
    finally:
        pub.close()
