"""Integration: the default model (SmolLM2-135M) through our forward, vs transformers' own."""

from __future__ import annotations

import pytest
import torch

from streamllm.engine import EngineConfig
from streamllm.engine.kv import BlockManager, BlockTable, KVPool, KVStore
from streamllm.engine.runner import Runner, Work
from streamllm.model.llama import LlamaForward

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def smollm2():
    from streamllm.model import load_model

    return load_model("smollm2-135m", progress=False)


@pytest.fixture(scope="module")
def hf(smollm2):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(smollm2.config, dtype=torch.float32)
    model.load_state_dict(smollm2.state_dict, strict=False)
    model.tie_weights()
    return model.eval()


def test_our_forward_matches_transformers_on_the_default_model(smollm2, hf):
    text = "12:00 BTCUSDT 64012.5 +3.2 h+1.5 v12.5 n210 b58\n12:01 BTCUSDT 64020.1 +7.6 v9.1 n150 b51\n"
    ids = smollm2.tokenizer(text * 4)["input_ids"]
    ours = LlamaForward(smollm2.config, smollm2.state_dict)
    store = KVStore(BlockManager(64, 16), KVPool(ours.num_layers, 64 * 16, ours.num_kv_heads, ours.head_dim))
    runner = Runner(ours, store)
    table = BlockTable()
    logits = []
    for start, n in ((0, 37), (37, 1), (38, len(ids) - 38)):  # chunked, a single token, the rest
        store.manager.append(table, n)
        (lg,) = runner.execute([Work(table, ids[start : start + n], start, "all")])
        logits.append(lg)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (torch.cat(logits) - ref).abs().max().item() <= 1e-4


def test_engine_paths_on_the_default_model(smollm2):
    from streamllm.config import QuestionSpec
    from streamllm.engine import Engine

    with Engine(smollm2, EngineConfig(max_cells=8192, max_context=2048)) as engine:
        engine.open_session("btc")
        engine.register("btc", QuestionSpec("dir", "Is the price going up or down? Answer with one word.",
                                            choices=("up", "down"), threshold=0.0, max_tokens=1))
        ack = engine.push("btc", [f"12:{i:02d} 640{i:02d}.5 +{i}.0 v1.{i} n{i + 10}" for i in range(20)])
        fast = engine.ask("btc", "dir", min_version=ack.data_version)
        assert fast.path == "fast" and fast.text in ("up", "down") and fast.tokens_computed == 0
        engine.open_session("twin")
        engine.push("twin", [f"12:{i:02d} 640{i:02d}.5 +{i}.0 v1.{i} n{i + 10}" for i in range(20)])
        cold = engine.ask("twin", "Is the price going up or down? Answer with one word.", max_tokens=1,
                          min_version=1, return_logits=True)
        gate = engine.prepos.find("btc", "dir").gate
        assert gate.decide(cold.logits).answer == fast.text


def test_entry_path_choice_answers_end_at_the_named_choice(smollm2):
    from streamllm.config import QuestionSpec
    from streamllm.engine import Engine

    with Engine(smollm2, EngineConfig(max_cells=8192, max_context=2048)) as engine:
        engine.open_session("btc")
        engine.register("btc", QuestionSpec("dir", "Is the price going up or down?", choices=("up", "down"),
                                            threshold=1e9, max_tokens=12))
        ack = engine.push("btc", [f"12:{i:02d} 640{i:02d}.5 +{i}.0 v1.{i} n{i + 10}" for i in range(20)])
        answer = engine.ask("btc", "dir", min_version=ack.data_version)
        assert answer.path == "entry"
        # SmolLM2 answers in a sentence ("The price is going up..."): it stops at the choice
        assert answer.text in ("up", "down") and answer.finish_reason == "stop"
        assert len(answer.tokens) < 12
