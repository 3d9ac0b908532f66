"""`appliance bench ...`: measurements printed side by side (medians, ratios), never pass/fail."""


from .cli import friendly, main, model_options  # noqa: F401


@main.group()
def bench():
    """Benchmarks: decode speed, forward vs end-to-end, prefill, kernels."""
