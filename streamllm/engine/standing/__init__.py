"""Standing questions: what the engine keeps ready between arrivals.

prepos.py the prepositioner (entries, series heads, published answers), gate.py the runtime
decision, calibration.py live scoring against truths and the `auto:P` threshold, learning.py
heads learned live. Only the core thread calls into them.
"""
