"""The measure wing: what a model weighs (`sizes.py`: weight, state and step bytes from a config alone), the
memory plans (`memory.py`), the benchmark library (`bench.py`; the `bench` commands live in cli/) and the
model's discrete choices recorded from outside it (`selections.py`: the model takes no measurement argument)."""
