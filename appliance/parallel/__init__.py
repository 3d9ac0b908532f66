"""The parallel wing: one model over several devices. The process group and its collectives (`world.py`),
splitting a loaded model over the ranks (`sharding.py`, a transformation applied after load) and moving
it to its device (`placement.py`). Imports the model wing; the model never imports this."""
