"""Run time: market events -> lines -> the engine (render, attach, summaries, feed supervision and wiring)."""
