"""`appliance probe --plot F.png`: the inter-token-gap histogram (log-spaced bins, log counts) beside a
per-request timeline (send at 0, a tick per token, TTFT marked). matplotlib is the optional `plot` extra."""

from appliance.errors import ApplianceError

from .client import ProbeRun
from .stats import percentile


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ApplianceError("--plot needs matplotlib: pip install 'decode-appliance[plot]' (or drop --plot)",
                             field="plot") from None
    matplotlib.use("Agg")  # files only; never a display
    import matplotlib.pyplot as plt

    return plt


def plot(run: ProbeRun, path) -> None:
    plt = _pyplot()
    recs = run.measured
    gaps = [g for r in recs for g in r.itl_ms if g > 0]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    if gaps:
        lo, hi = min(gaps), max(gaps)
        hi = hi if hi > lo else lo * 1.01 + 1e-3
        n_bins = 40
        edges = [lo * (hi / lo) ** (i / n_bins) for i in range(n_bins + 1)]
        ax1.hist(gaps, bins=edges, color="tab:blue")
        ax1.set_xscale("log")
        ax1.set_yscale("log")
        ordered = sorted(gaps)
        for p, style in ((50, "-"), (99, "--")):
            x = percentile(ordered, p)
            ax1.axvline(x, color="black", linestyle=style, linewidth=1, label=f"p{p} {x:.2f} ms")
        ax1.legend()
    else:
        ax1.text(0.5, 0.5, "no inter-token gaps", ha="center", va="center", transform=ax1.transAxes)
    ax1.set_xlabel("inter-token gap (ms, log)")
    ax1.set_ylabel("count (log)")
    ax1.set_title(f"inter-token gaps ({len(gaps)} from {len(recs)} requests)")

    for i, r in enumerate(recs):
        if r.e2e_ms is not None:
            ax2.hlines(i, 0, r.e2e_ms, color="lightgray", linewidth=1)
        if r.token_ms:
            ax2.scatter(r.token_ms, [i] * len(r.token_ms), marker="|", s=30, color="tab:blue", linewidths=0.8)
        if r.ttft_ms is not None:
            ax2.scatter([r.ttft_ms], [i], marker="o", s=18, color="tab:red", zorder=3)
    ax2.set_xlabel("ms since the request was sent (red: first token)")
    ax2.set_ylabel("request")
    ax2.yaxis.get_major_locator().set_params(integer=True)
    ax2.set_title("per-request timeline")
    fig.suptitle(f"{run.hello.get('model')} via {run.config.url}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
