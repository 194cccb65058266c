"""bf16 against the fp32 reference: logits within a documented tolerance, same top-1, same gate decisions.

Tolerances (docs/engine.md): max |logit difference| over the whole vocabulary, bf16 vs fp32,
measured 0.04-0.06 on the tiny model and 0.6-0.7 on SmolLM2-135M (logits up to ~40):
bf16 keeps 8 bits of mantissa in the weights, the matmul inputs and outputs and the KV
cells. Top-1 must agree wherever fp32's top-1 leads by more than twice the tolerance.
"""

from __future__ import annotations

import os

import pytest
import torch

from bench import dtype as dt
from streamllm.config import parse_question
from streamllm.durability.snapshot import SnapshotError, restore_session, save_session
from streamllm.engine import Engine, EngineConfig
from streamllm.engine.kv import BlockManager, BlockTable, KVPool, KVStore
from streamllm.engine.runner import Runner, Work
from streamllm.model.dtype import parse_dtype, resolve_dtype
from streamllm.model.llama import LlamaForward

DEVICE = os.environ.get("STREAMLLM_TEST_DEVICE", "cpu")  # bench/gpu_check.sh runs these on cuda
TINY_TOL = 0.15
SMOLLM2_TOL = 1.0
LINES = [f"12:00:{i:02d} BTCUSDT O 640{i:02d}.5 C 640{i:02d}.2 V {i}.5" for i in range(24)]
QUESTION = parse_question({"id": "trend", "text": "Up or down?", "choices": ["up", "down"], "threshold": 0.0})


def runner_for(loaded, dtype: str, fp32_rows: int | None = 0) -> Runner:
    model = LlamaForward(loaded.config, loaded.state_dict, device=DEVICE, dtype=dtype, fp32_rows=fp32_rows)
    pool = KVPool(model.num_layers, 128 * 16, model.num_kv_heads, model.head_dim, dtype=model.kv_dtype,
                  device=DEVICE)
    return Runner(model, KVStore(BlockManager(128, 16), pool))


def chunked_logits(runner: Runner, ids: list[int], pieces: tuple[int, ...]) -> torch.Tensor:
    """Logits of every position, computed as a prefill chunk, single tokens, then the rest."""
    table, out, pos = BlockTable(), [], 0
    for n in (*pieces, len(ids) - sum(pieces)):
        runner.store.manager.append(table, n)
        (lg,) = runner.execute([Work(table, ids[pos : pos + n], pos, "all")])
        out.append(lg)
        pos += n
    return torch.cat(out).cpu()


def assert_close_to_reference(ref: torch.Tensor, got: torch.Tensor, tol: float) -> None:
    assert got.dtype == torch.float32  # logits leave the model in fp32 whatever it runs in
    assert (ref - got).abs().max().item() <= tol
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * tol
    assert clear.any()
    assert torch.equal(ref.argmax(-1)[clear], got.argmax(-1)[clear])


def test_dtype_names_are_checked(monkeypatch):
    assert parse_dtype("bf16") == parse_dtype("bfloat16") == torch.bfloat16
    assert parse_dtype(None) == parse_dtype("auto") == "auto"
    with pytest.raises(ValueError, match="unknown dtype 'fp16'.*auto, float32, bfloat16"):
        parse_dtype("fp16")
    with pytest.raises(ValueError, match="float16 is not supported"):
        parse_dtype(torch.float16)
    assert resolve_dtype("float32", "cpu").reason == "float32 (requested)"
    monkeypatch.setenv("STREAMLLM_DTYPE", "bf16")
    assert resolve_dtype("auto", "cpu").dtype == torch.bfloat16
    assert resolve_dtype("auto", "cpu").requested == "bfloat16"  # asked for by name: no copies of another dtype
    assert resolve_dtype("float32", "cpu").dtype == torch.float32  # an explicit choice wins
    monkeypatch.setenv("STREAMLLM_DTYPE", "half")
    with pytest.raises(ValueError, match=r"\$STREAMLLM_DTYPE: unknown dtype 'half'"):
        resolve_dtype("auto", "cpu")
    monkeypatch.delenv("STREAMLLM_DTYPE")
    auto = resolve_dtype("auto", "cpu")  # the probe: which kernel oneDNN runs a bf16 product on
    assert auto.requested == "auto" and auto.reason.startswith(f"{auto.name} (auto: ")


@pytest.mark.parametrize("fp32_rows", [0, 4])
def test_tiny_bf16_logits_match_fp32_within_tolerance(tiny_model, fp32_rows):
    ids = tiny_model.tokenizer("\n".join(LINES))["input_ids"][:160]
    ref = chunked_logits(runner_for(tiny_model, "float32"), ids, (50, 1, 1, 3))
    runner = runner_for(tiny_model, "bfloat16", fp32_rows)
    model = runner.model
    assert model.dtype == model.kv_dtype == torch.bfloat16 and model.embed.dtype == torch.bfloat16
    assert model.final_norm.dtype == torch.float32  # norms are applied in fp32
    assert bool(model._w32) == bool(fp32_rows)  # fp32 copies exist only when few-row steps use them
    assert_close_to_reference(ref, chunked_logits(runner, ids, (50, 1, 1, 3)), TINY_TOL)


def test_few_row_steps_use_the_fp32_copies(tiny_model):
    ids = tiny_model.tokenizer("\n".join(LINES))["input_ids"][:40]
    fp32 = chunked_logits(runner_for(tiny_model, "float32"), ids, (39,))[-1]
    pure = chunked_logits(runner_for(tiny_model, "bfloat16", 0), ids, (39,))[-1]
    copies = chunked_logits(runner_for(tiny_model, "bfloat16", 1), ids, (39,))[-1]
    # the same cells (the 39-row prefill is bf16 in both), a different last step: fp32 weights there
    assert not torch.equal(pure, copies)
    assert (copies - fp32).abs().max() <= TINY_TOL and (pure - fp32).abs().max() <= TINY_TOL


def test_auto_on_cuda_takes_bf16_where_the_gpu_has_it(monkeypatch):
    """The CUDA rule, checked without a GPU (the kernels themselves: bench/gpu_check.sh)."""
    monkeypatch.delenv("STREAMLLM_DTYPE")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Test GPU")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert resolve_dtype("auto", "cuda").reason == "bfloat16 (auto: Test GPU)"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert resolve_dtype("auto", "cuda").dtype == torch.float32
    with pytest.raises(ValueError, match="bfloat16 requested but Test GPU has no bf16 support"):
        resolve_dtype("bfloat16", "cuda")


def test_cells_of_another_dtype_are_refused(tiny_model):
    model = LlamaForward(tiny_model.config, tiny_model.state_dict, dtype="bfloat16", fp32_rows=0)
    pool = KVPool(model.num_layers, 64, model.num_kv_heads, model.head_dim)  # fp32 cells
    runner = Runner(model, KVStore(BlockManager(8, 8), pool))
    table = BlockTable()
    runner.store.manager.append(table, 3)
    with pytest.raises(ValueError, match="KV cells are torch.float32/torch.float32, the model runs torch.bfloat16"):
        runner.execute([Work(table, [1, 2, 3], 0, "last")])


def test_engine_reports_its_dtype_and_answers_in_bf16(tiny_model):
    from streamllm.service.server import StreamServer

    with Engine(tiny_model, EngineConfig(max_cells=4096, block_size=8, max_context=1024), device=DEVICE, dtype="bfloat16") as engine:
        assert engine.stats()["dtype"] == "bfloat16" and engine.store.pool.k.dtype == torch.bfloat16
        assert StreamServer(engine).health()["dtype"] == "bfloat16"
        engine.open_session("s", "You watch bars.")
        engine.register("s", QUESTION)
        ack = engine.push("s", LINES)
        answer = engine.ask("s", "trend", min_version=ack.data_version)
        assert answer.path == "fast" and answer.text in ("up", "down")
    with Engine(tiny_model, EngineConfig(max_cells=1024, block_size=8, max_context=512), device=DEVICE, dtype="float32") as engine:
        assert engine.stats()["dtype"] == "float32"


def test_snapshots_record_their_dtype_and_refuse_another(tiny_model, tmp_path):
    path = tmp_path / "s.safetensors"
    with Engine(tiny_model, EngineConfig(max_cells=4096, block_size=8, max_context=1024), device=DEVICE, dtype="bfloat16") as engine:
        engine.open_session("s", "You watch bars.")
        engine.push("s", LINES)
        engine.wait_idle()
        save_session(engine, "s", path)
        restore_session(engine, path, "twin")  # same dtype: restored
        a, b = engine.sessions["s"], engine.sessions["twin"]
        slots_a = engine.store.manager.slots(a.table, 0, a.num_computed)
        slots_b = engine.store.manager.slots(b.table, 0, b.num_computed)
        assert torch.equal(engine.store.pool.k[:, :, slots_a], engine.store.pool.k[:, :, slots_b])
    with Engine(tiny_model, EngineConfig(max_cells=4096, block_size=8, max_context=1024), device=DEVICE, dtype="float32") as engine:
        with pytest.raises(SnapshotError, match="cells are bfloat16, this engine runs float32"):
            restore_session(engine, path)
        assert not engine.sessions


# -- the default model ----------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2():
    from streamllm.model import load_model

    return load_model("smollm2-135m", progress=False)


@pytest.mark.integration
def test_smollm2_bf16_logits_match_fp32_within_tolerance(smollm2):
    text = "12:00 BTCUSDT 64012.5 +3.2 h+1.5 v12.5 n210 b58\n12:01 BTCUSDT 64020.1 +7.6 v9.1 n150 b51\n"
    ids = smollm2.tokenizer(text * 4)["input_ids"]
    ref = chunked_logits(runner_for(smollm2, "float32"), ids, (37, 1))
    assert_close_to_reference(ref, chunked_logits(runner_for(smollm2, "bfloat16", None), ids, (37, 1)), SMOLLM2_TOL)


@pytest.mark.integration
def test_smollm2_bf16_flips_no_clear_gate_decision(smollm2):
    """Every shipped question text with choices, under the first system prompt that asks it, at three points
    of a synthetic bar context (4, 8 and 12 lines: each line is ~50 tokens, every system prompt prefills its
    own context in fp32, and bf16 runs emulated on CPUs without AVX512-BF16). `bench query` checks every
    (system prompt, question) pair of the shipped configs, on longer contexts."""
    ref, bf16 = dt.make_rig(smollm2, "float32", 4096, DEVICE), dt.make_rig(smollm2, "bfloat16", 4096, DEVICE)
    first: dict[str, dt.GateCase] = {}
    for case in dt.shipped_gate_cases():
        first.setdefault(case.spec.text, case)
    parity = dt.gate_parity(ref, bf16, smollm2.tokenizer, [dt.synthetic_lines(1, 12)], [4, 8, 12], list(first.values()))
    assert parity.decisions >= 20
    assert parity.flips == 0, [d for d in parity.details if (d["fired"], d["answer"]) != (d["fired_ref"],
                                                                                          d["answer_ref"])]
    assert parity.top1_changed == 0
    assert parity.max_abs_logit_diff <= SMOLLM2_TOL
