"""Short text cells for a question's live figures (terminal tables: demo, watch; the page's app.js
mirrors them). No torch: the thin client imports it."""

from __future__ import annotations


def calibration_cells(c: dict | None) -> tuple[str, str]:
    """A question's live figures (a summary's to_dict) as the two short cells the terminal tables
    show (demo, watch; the page's app.js mirrors them): right "97% of 31, base 62%", gate "100% at
    97%" or "closed" (an auto gate without evidence); "-" for both without a scored answer."""
    if not c or not c.get("samples"):
        return "-", "-"
    right = f"{percent(c.get('accuracy'))} of {c['samples']}"
    if c.get("base_rate") is not None:
        right += f", base {percent(c['base_rate'])}"
    if c.get("threshold") is None and c.get("target") is not None:
        return right, "closed"
    return right, f"{percent(c.get('coverage'))} at {percent(c.get('precision'))}"


def percent(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"
