"""The adapter card `streamllm tune` writes beside an adapter: card.md from card.json's figures."""

from __future__ import annotations

from typing import Any

from streamllm.evaluation.intervals import LEVEL, REPS

_UNITS = {"price": "price units", "bp": "basis points of the previous close"}


def _orders(series: dict[str, Any]) -> str:
    n = series.get("fit_orders", 1)
    rule = (" (the fewest features, then the most weight decay, within one standard error of the lowest)"
            if series.get("choose") == "simplest" else "")
    reduce = series.get("reduce")
    reduced = (f"; a feature set wider than {reduce} columns fitted through its {reduce} leading principal "
               "components" if reduce else "")
    return reduced + (f"; each head the mean of {n} fits in their own minibatch orders, its features and weight "
                      f"decay chosen by their mean development loss{rule}" if n > 1 else "")


def _line_features(series: dict[str, Any]) -> str:
    words = series.get("words") or []
    named = "".join(f", word {w}'s last token" if isinstance(w, int) else f", the {w}... word's last token"
                    for w in words)
    return f"[mean over its tokens, last token{named}]" + (" (each head reads all, or the words alone: see features)"
                                                            if words else "")


def _intro(card: dict[str, Any]) -> list[str]:
    mix = card.get("mix") or []
    mixed = f" (training also on {', '.join(mix)})" if mix else ""
    data = (f"Data: {', '.join(card['data'])}{mixed}; judged also on {', '.join(card['judge']) or 'no captures'} and "
            f"synthetic regimes. Windows of {card['window_bars']} bars, a decision point every {card['stride']} bars; "
            f"decision points per set: {card['decision_points']}. Lines write changes in "
            f"{_UNITS[card.get('changes', 'price')]} (`[sessions.render] changes`; sessions must match).")
    if card["method"] == "lora":
        lo = card["lora"]
        return [f"# LoRA for {card['config']} (sessions {', '.join(card['sessions'])})", "",
                f"Method `lora` on `{card['model']}`: peft LoRA r={lo['rank']} alpha={lo['alpha']} on every projection "
                f"of layers {lo['adapted_layers'][0]}-{lo['adapted_layers'][-1]}, merged into the weights at load. "
                f"This run: {card['minutes']} min ({card['train_minutes']} preparing and training), {card['steps']} "
                f"steps of {lo['points']} decision points (lr {lo['lr']}, KL {lo['kl']}, bf16 autocast "
                f"{lo['autocast_bf16']}); best dev loss {card['best_dev_loss']} at step {card['best_step']}; "
                f"{card['adapter_bytes']} bytes.", data, "",
                "The gate scores a choice by its best first token's logit (the engine's own rule); threshold: the "
                f"margin reaching precision {card['target_precision']} on the dev range (none: never on at least 10 "
                "fired samples). Base model: the same rule on the unadapted model, its own dev threshold. Questions "
                "named adhoc_* were never trained on: they show whether the model stayed general.", ""]
    every = f"{card['tokens_all_windows']} tokens"
    if "extract_minutes_all_windows" in card:  # what extracting them all cost, as each checkpoint recorded it
        untimed = card.get("windows_untimed", 0)
        every += f", {card['extract_minutes_all_windows']} min extracting" + (
            f" (not counting {untimed} windows checkpointed before times were kept)" if untimed else "")
    run = (f"This run: {card['minutes']} min ({card['extract_minutes']} extracting {card['tokens_extracted']} "
           f"tokens; all windows, resumed ones included: {every})")
    gate = (f"Gate threshold: the head's margin reaching precision {card['target_precision']} on the dev range "
            "(none: it never did on at least 10 fired samples, so the gate stays closed). ECE: how far the "
            "answers' choice probabilities are from how often they were right (expected calibration error, 10 bins).")
    if card["method"] == "series":
        se = card["series"]
        return [f"# Series heads for {card['config']} (sessions {', '.join(card['sessions'])})", "",
                f"Method `series` on `{card['model']}`: per question, a readout over the session's last {se['lines']} "
                f"lines, each line read as {_line_features(se)} of the residual stream after layer {se['tap_layer']}, "
                f"projected to {se['rank']} numbers (plus their magnitudes) and weighed per line{_orders(se)}. Judged at "
                f"every bar with {se['lines']} lines of history (base model: at the decision points of the sets never "
                f"trained or tuned on{_base_windows(card)}). {run}, "
                f"{card['fit_steps']} AdamW steps, {card['adapter_bytes']} bytes.", data, "", gate, ""]
    return [f"# Choice heads for {card['config']} (sessions {', '.join(card['sessions'])})", "",
            f"Method `{card['method']}` on `{card['model']}`: a readout over the final normed hidden state at each "
            f"question's decision point. {run}, {card['fit_steps']} LBFGS steps, {card['adapter_bytes']} bytes.",
            data, "", gate, ""]


def _base_windows(card: dict[str, Any]) -> str:
    n = card.get("base_model_windows")  # absent on cards from before the setting: every judged window
    return f", in the first {n} windows of each source" if n else ""


def _ece(judged: dict[str, Any]) -> str:
    """Expected calibration error of the answers' probabilities ('-' on cards from before it)."""
    return "-" if judged.get("ece") is None else format(judged["ece"], ".2f")


def _with_interval(j: dict[str, Any], key: str) -> str:
    """A figure and, where the card has one, its block-bootstrap interval: "0.69 (0.55-0.82)"."""
    span = j.get(f"{key}_interval")
    return f"{j[key]:.2f}" + ("" if span is None else f" ({span[0]:.2f}-{span[1]:.2f})")


INTERVALS = (f"In brackets: the middle {LEVEL:.0%} of {REPS} block-bootstrap resamples (blocks of consecutive bars "
             "as long as the label's history, within one window; neighbouring bars are not independent samples). "
             "A set of one short window, such as a capture, has few blocks: its figures are rough.")


def fmt_number(x: float | None, spec: str = ".2f") -> str:
    """A figure for a table (the card's, calibrate's report): "-" where there is none."""
    return "-" if x is None else format(x, spec)


def card_markdown(card: dict[str, Any]) -> str:
    judged = [j for q in card["questions"].values() for j in q["judged"].values()]
    lines = _intro(card) + ([INTERVALS, ""] if any("accuracy_interval" in j for j in judged) else []) + [
             "| question | set | n | accuracy | base rate | balanced acc | ranks | base model acc | coverage @thr | "
             "precision @thr | coverage at target (own) | ECE |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for qid, q in card["questions"].items():
        for s, j in q["judged"].items():
            if not j.get("samples"):
                continue
            base = q["base_model"].get(s)  # none: tuned with --no-base-model
            base_acc = fmt_number(base and base["accuracy"])
            if base and base.get("samples") != j["samples"]:  # from the set's first windows (--base-model-windows)
                base_acc += f" (n={base.get('samples')})"
            lines.append(f"| {qid} | {s} | {j['samples']} | {_with_interval(j, 'accuracy')} | {j['base_rate']:.2f} "
                         f"({j['majority']}) | {fmt_number(j.get('balanced_accuracy'))} | {fmt_number(j.get('ranks'))} | "
                         f"{base_acc} | {j['coverage']:.2f} | {fmt_number(j['precision'])} | "
                         f"{_with_interval(j, 'coverage_at_target')} | {_ece(j)} |")
    first = [(qid, s, j) for qid, q in card["questions"].items() for s, j in q.get("first_lines", {}).items()
             if j.get("samples")]
    if first:
        lines += ["", f"A session's first lines (fewer than {card['series']['lines']} held): each head reads all there "
                  "are once its label's history is (min lines: " + ", ".join(
                      f"{qid} {q['min_lines']}" for qid, q in card["questions"].items() if "min_lines" in q) + ").", "",
                  "| question | set | n | accuracy | base rate | coverage @thr | precision @thr | ECE |",
                  "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {qid} | {s} | {j['samples']} | {_with_interval(j, 'accuracy')} | {j['base_rate']:.2f} ({j['majority']}) | "
                  f"{j['coverage']:.2f} | {fmt_number(j['precision'])} | {_ece(j)} |"
                  for qid, s, j in first]
    lines += ["", "Thresholds: " + ", ".join(f"{qid} {q['threshold']}" for qid, q in card["questions"].items()), ""]
    if any("features" in q for q in card["questions"].values()):
        lines += ["Features read: " + ", ".join(f"{qid} {q['features']}" for qid, q in card["questions"].items()
                                                if "features" in q), ""]
    return "\n".join(lines)
