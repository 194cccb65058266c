"""The tiny test model: a seeded random 2-layer Llama and a locally trained tokenizer.

No download, deterministic across calls and processes, built in well under a second,
so unit tests can exercise the whole engine (tokenize, chat template, forward, KV).
"""

from __future__ import annotations

import functools

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

TINY_VOCAB_TARGET = 512
# Larger than Llama's 0.02 so random logits have a real spread and greedy decoding
# does not collapse onto one token.
TINY_INIT_STD = 0.1
TINY_SEED = 0

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# ChatML, the same turn format as SmolLM2-Instruct (without its default system prompt).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_SYMBOLS = ("BTCUSDT", "ETHUSDT", "SOLUSDT", "AAPL", "MSFT", "ES", "EURUSD")
_BASE_PRICES = (64012.5, 3120.25, 142.7, 189.31, 411.05, 5210.0, 1.0842)

_ENGLISH = """\
You are a market analyst. Answer with one word when you can.
Is BTC trending up over the last 10 bars? yes no up down flat
What is the last close? Which symbol moved most? Why did volume rise?
When was the high? Where is support? How much did the price change?
Did the spread widen? Will the trend continue? Answer yes or no.
The price is rising. The price is falling. Volume is high. Volume is low.
trade quote bar bid ask last open high low close volume spread
"""


def _market_corpus() -> list[str]:
    """Bars, trades and quotes in the engine's compact line format, from fixed formulas."""
    lines: list[str] = []
    for s, (symbol, base) in enumerate(zip(_SYMBOLS, _BASE_PRICES, strict=True)):
        decimals = 4 if base < 10 else 2 if base < 1000 else 1
        for minute in range(24):
            # A deterministic wiggle: no RNG, so the corpus (and the merges) never change.
            drift = ((minute * 7 + s * 3) % 11 - 5) * base * 1e-4
            o = base + drift
            h = o + abs(drift) + base * 2e-4
            lo = o - base * 3e-4
            c = (h + lo) / 2
            v = ((minute * 13 + s) % 97) / 4 + 0.5
            t = f"12:{minute:02d}:{(minute * 17 + s) % 60:02d}"
            lines.append(
                f"{t} {symbol} O {o:.{decimals}f} H {h:.{decimals}f} L {lo:.{decimals}f} "
                f"C {c:.{decimals}f} V {v:.1f}"
            )
            side = "B" if (minute + s) % 2 else "S"
            lines.append(f"{t} {symbol} T {c:.{decimals}f} x {v / 3:.2f} {side}")
            lines.append(f"{t} {symbol} Q {lo:.{decimals}f} / {h:.{decimals}f}")
    return lines + _ENGLISH.splitlines()


@functools.cache
def _trained_tokenizer_json() -> str:
    """Train once per process; the serialized form is cached so every caller gets a fresh copy."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_TARGET,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_market_corpus(), trainer=trainer)
    return tokenizer.to_str()


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE (~500 tokens) with ChatML special tokens and chat template."""
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_trained_tokenizer_json()),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        chat_template=CHATML_TEMPLATE,
        model_max_length=4096,
    )


def tiny_config(vocab_size: int, *, eos_token_id: int, pad_token_id: int) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
        vocab_size=vocab_size,
        initializer_range=TINY_INIT_STD,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        bos_token_id=None,
        architectures=["LlamaForCausalLM"],
    )


def tiny_weights(config: LlamaConfig) -> dict[str, torch.Tensor]:
    """Seeded random weights; the caller's global RNG state is left untouched."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(TINY_SEED)
        model = LlamaForCausalLM(config)
    return {name: t.detach().contiguous() for name, t in model.state_dict().items()}
