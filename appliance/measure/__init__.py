"""The measure wing: what a model weighs (`sizes.py`: weight, state and step bytes from a config alone), the
memory plans (`memory.py`) and the benchmark library (`bench.py`; the `bench` commands live in cli/)."""
