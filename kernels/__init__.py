"""Small-batch decode ops. Each `kernels/<op>.py` holds the op's torch `reference` (the readable
definition, with the bytes it moves) and, where one exists, its Triton kernel behind a public wrapper.
`kernels.registry` resolves an op name to one of the two; the model code only sees the registry.
This package imports nothing of the project above it."""
