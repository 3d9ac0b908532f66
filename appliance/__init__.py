"""decode-appliance: the engine (configs, weights, model math, decode state, speculative decoding, the
Engine API) and the command line."""

__version__ = "0.1.0"
