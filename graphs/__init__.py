"""Capture and replay of the decode cycle as CUDA graphs, with an eager runner of the same interface for
CPU. Knows buffers and a callable, not the model; imports nothing of this project above it."""
