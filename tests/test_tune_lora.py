"""`streamllm tune --method lora` on the tiny model: packing, training, merging, loading."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
import torch

pytest.importorskip("peft")

from feeds.sources import TableSource  # noqa: E402
from streamllm.cli.tune import main as cli_main  # noqa: E402
from streamllm.engine import Engine, EngineConfig  # noqa: E402
from streamllm.engine.prompt import PromptLayout  # noqa: E402
from streamllm.model.adapter import AdapterError, load_adapter  # noqa: E402
from streamllm.model.lora import merged_state_dict, save_lora  # noqa: E402
from streamllm.tuning.extract import StateExtractor, render_window  # noqa: E402
from streamllm.tuning.lora import ChoiceScorer, LoraSettings, LoraTrainer, pack  # noqa: E402
from tests.test_tune import CONFIG, write_bars  # noqa: E402


@pytest.fixture
def window(tmp_path):
    return TableSource(write_bars(tmp_path / "bars.csv", 24), "bar", instrument="TEST").events()


def labelled(session):
    return [q for q in session.questions if q.label is not None]


def trainer_for(tiny_model, **kw) -> LoraTrainer:
    return LoraTrainer(tiny_model, LoraSettings(layers=1, bf16=False, **kw))


def reference_scores(loaded, session, bars, scorer) -> dict[str, torch.Tensor]:
    """Choice scores from the engine's own forward at each decision point (StateExtractor: branches on KV forks)."""
    qs = labelled(session)
    states = StateExtractor(loaded, session, qs).extract(bars, stride=1, first=min(q.label.bars_needed for q in qs) - 1)
    head = loaded.state_dict.get("lm_head.weight", loaded.state_dict["model.embed_tokens.weight"])
    return {qid: scorer(qid, x, head) for qid, x in states.features.items()}


def test_packed_blocks_are_the_engines_entries(tiny_model, spec, window):
    """One packed sequence with a masked block per decision point gives the engine's entry state at each."""
    layout = PromptLayout(tiny_model.tokenizer)
    packed = pack(layout, spec, window, labelled(spec), 1)
    lines = render_window(window)
    extractor = StateExtractor(tiny_model, spec, labelled(spec))
    for b in packed.blocks[:: max(1, len(packed.blocks) // 5)]:  # the block's rows, as the engine's prompt
        q = next(q for q in spec.questions if q.id == b.qid)
        visible = packed.ids[: b.sees].tolist() + packed.ids[b.start: b.start + b.length].tolist()
        assert visible == extractor.decision_prompt(lines, b.bar, q)
        assert packed.positions[b.start] == b.sees
    scorer = ChoiceScorer(labelled(spec), tiny_model.tokenizer)
    trainer = trainer_for(tiny_model)
    trainer.prepare(packed, scorer, random.Random(0))
    want = reference_scores(tiny_model, spec, window, scorer)
    for qid, got in packed.extra["base_scores"].items():
        torch.testing.assert_close(got, want[qid], atol=1e-4, rtol=1e-4)
    # the lower layers' cached states + the top layers (adapter still zero) give the same
    for qid, got in trainer.scores(packed, scorer).items():
        torch.testing.assert_close(got, want[qid], atol=1e-4, rtol=1e-4)


def test_a_sub_batch_sees_what_the_whole_window_sees(tiny_model, spec, window):
    layout = PromptLayout(tiny_model.tokenizer)
    packed = pack(layout, spec, window, labelled(spec), 1)
    blocks = packed.blocks[3:9:2]
    sub, index = packed.sub(blocks)
    full, part = packed.mask(), sub.mask()
    assert torch.equal(part, full[index][:, index])
    assert sub.session_rows == max(b.sees for b in blocks)


def test_training_lowers_the_loss_and_the_merged_engine_matches_peft(tiny_model, spec, window, tmp_path):
    layout = PromptLayout(tiny_model.tokenizer)
    packed = pack(layout, spec, window, labelled(spec), 1)
    scorer = ChoiceScorer(labelled(spec), tiny_model.tokenizer)
    trainer = trainer_for(tiny_model, lr=3e-3, points=64, kl=0.0)
    trainer.prepare(packed, scorer, random.Random(0))
    rng = random.Random(1)
    losses = [trainer.train_step(packed, scorer, rng) for _ in range(15)]
    assert losses[-1] < losses[0]
    (tmp_path / "ad").mkdir()
    save_lora(trainer.peft, tmp_path / "ad")
    (tmp_path / "ad" / "lora" / "streamllm.json").write_text(json.dumps(
        {"format": "streamllm-lora", "model": tiny_model.name, "hidden_size": tiny_model.config.hidden_size}))
    merged = dataclasses.replace(tiny_model, state_dict=merged_state_dict(tiny_model, tmp_path / "ad"))
    want = reference_scores(merged, spec, window, scorer)  # our forward on the merged weights
    for qid, got in trainer.scores(packed, scorer).items():  # peft's unmerged forward
        torch.testing.assert_close(got, want[qid], atol=1e-3, rtol=1e-3)
    assert not torch.equal(merged.state_dict["model.layers.1.mlp.down_proj.weight"],
                           tiny_model.state_dict["model.layers.1.mlp.down_proj.weight"])
    assert torch.equal(merged.state_dict["model.layers.0.mlp.down_proj.weight"],  # below the adapted layers
                       tiny_model.state_dict["model.layers.0.mlp.down_proj.weight"])

    engine = Engine(tiny_model, EngineConfig(max_cells=4096, max_context=2048), adapter=tmp_path / "ad")
    plain = Engine(tiny_model, EngineConfig(max_cells=4096, max_context=2048))
    try:
        assert engine.adapter.lora and engine.adapter_id
        q = labelled(spec)[0]
        outs = []
        for e in (engine, plain):
            e.open_session("test", system=spec.system_prompt)
            e.register("test", q)
            e.push("test", render_window(window))
            e.wait_idle()
            outs.append(e.prepos.find("test", q.id).ready_logits)
        # the engine's entry after the last bar, scored per choice as the gate does
        per_choice = [outs[0][scorer.ids[q.id][scorer.owner[q.id] == c]].max() for c in range(2)]
        torch.testing.assert_close(torch.stack(per_choice), want[q.id][-1], atol=1e-3, rtol=1e-3)
        assert not torch.allclose(outs[0], outs[1])
    finally:
        engine.shutdown()
        plain.shutdown()


def test_tune_lora_writes_an_adapter_the_engine_loads(tiny_model, tmp_path, monkeypatch):
    import streamllm.model.loader as loader

    monkeypatch.setattr(loader, "load_model", lambda *a, **k: tiny_model)
    config = tmp_path / "q.toml"
    config.write_text(CONFIG)
    data = write_bars(tmp_path / "bars.csv", 600)
    out = tmp_path / "out"
    argv = ["--questions", str(config), "--data", str(data), "--out", str(out), "--model", "tiny",
            "--method", "lora", "--lora-layers", "1", "--window", "40", "--stride", "2", "--train-windows", "3",
            "--dev-windows", "1", "--later-windows", "1", "--synthetic-bars", "0", "--no-progress",
            "--max-steps", "4", "--eval-every", "2", "--points", "8"]
    assert cli_main(argv) == 0
    card = json.loads((out / "card.json").read_text())
    assert card["method"] == "lora" and card["steps"] == 4 and card["lora"]["adapted_layers"] == [1]
    assert set(card["questions"]) >= {"trend", "sma", "adhoc_trend_5"} and card["questions"]["adhoc_trend_5"]["adhoc"]
    assert card["decision_points"]["train"] == 3 * 2 * 17
    assert [h["step"] for h in card["history"]] == [0, 2, 4]
    assert (out / "card.md").read_text().startswith("# LoRA for")
    adapter = load_adapter(out)
    assert adapter.lora and not adapter.heads and adapter.model == "tiny"
    assert cli_main([*argv, "--resume", "--max-steps", "6"]) == 0  # continues from the checkpoint
    assert json.loads((out / "card.json").read_text())["steps"] == 6


def test_a_lora_of_another_model_is_refused(tiny_model, tmp_path):
    trainer = trainer_for(tiny_model)
    save_lora(trainer.peft, tmp_path / "ad")
    with pytest.raises(AdapterError, match="streamllm.json"):
        load_adapter(tmp_path / "ad")
    (tmp_path / "ad" / "lora" / "streamllm.json").write_text(json.dumps(
        {"format": "streamllm-lora", "model": "smollm2-135m", "hidden_size": 576}))
    with pytest.raises(AdapterError, match="trained on 'smollm2-135m'"):
        Engine(tiny_model, EngineConfig(max_cells=1024, max_context=512), adapter=tmp_path / "ad")


class _RunsCode:
    """Unpickling this calls os.makedirs(marker): what a hostile checkpoint could do with any call."""

    def __init__(self, marker) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        import os

        return (os.makedirs, (self.marker,))


def test_checkpoints_load_as_plain_data_and_run_no_code(tiny_model, tmp_path):
    import pickle

    from streamllm.tuning.lora_run import _load_packed

    trainer = trainer_for(tiny_model)
    ckpt = tmp_path / "lora-checkpoint.pt"
    trainer.save_checkpoint(ckpt, {"history": [{"step": 0, "dev_loss": 0.5}], "best_loss": 0.5, "best_step": 0,
                                   "best": trainer.lora_state()})
    again = trainer_for(tiny_model)
    assert again.load_checkpoint(ckpt)["history"] == [{"step": 0, "dev_loss": 0.5}]  # what we write loads
    marker = tmp_path / "code-ran"
    hostile = {"lora": trainer.lora_state(), "opt": _RunsCode(marker), "step": 0}
    torch.save(hostile, ckpt)
    with pytest.raises(pickle.UnpicklingError):
        again.load_checkpoint(ckpt)
    torch.save({"ids": _RunsCode(marker), "positions": [], "session_rows": [], "blocks": [], "extra": {}},
               tmp_path / "packed.pt")
    with pytest.raises(pickle.UnpicklingError):
        _load_packed(tmp_path / "packed.pt")
    assert not marker.exists()
