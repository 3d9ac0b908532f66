"""`appliance bench ...`: measurements printed side by side (medians, ratios), never pass/fail."""


from .main import friendly, main, model_options  # noqa: F401


@main.group()
def bench():
    """Benchmarks: decode speed, forward vs end-to-end, prefill, kernels."""


import click  # noqa: E402  (appended section: kernels)


@bench.command("kernels")
@click.option("--json", "as_json", is_flag=True, help="print the results as JSON")
@click.option("--iters", type=int, default=50, show_default=True, help="timed calls per op (median)")
@click.option("--tiny", is_flag=True, help="toy shapes (without CUDA: under the Triton interpreter)")
def bench_kernels(as_json, iters, tiny):
    """Each kernel at V4.1 decode shapes, M = 1 and 6: time, bytes moved, GB/s, fraction of copy bandwidth."""
    import json

    from kernels import bench as kb

    notes = []
    results = kb.run(iters=iters, tiny=tiny, notice=notes.append if as_json else click.echo)
    if as_json:
        click.echo(json.dumps({"notes": notes, "measured": bool(results), "results": kb.as_json(results)}, indent=1))
    elif results:
        click.echo(kb.table(results))
    else:
        click.echo("(run with --tiny to exercise the harness at toy shapes under the interpreter)")
