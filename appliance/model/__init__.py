"""The model wing: what a checkpoint is and computes, in plain torch over the op registry. Configs, weights,
tokenizer, the decode state and one forward step, the blocks every family shares, one file per family
(`deepseek_v4.py`, `deepseek_v41.py`) and one per drafter, and the tiny random checkpoints. Imports kernels
and appliance.errors only: nothing here knows graphs, ranks or requests."""
