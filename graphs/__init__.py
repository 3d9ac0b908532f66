"""Capture and replay of the decode cycle as CUDA graphs, with an eager runner of the same interface for
CPU: `runner.py` (one step: eager or captured) and `graph_set.py` (a session's keyed set of runners, one
pool, largest first, a timing hook). Knows buffers and a callable, not the model; imports nothing of this
project above it."""
