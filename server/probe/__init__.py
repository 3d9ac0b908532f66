"""The latency probe: `client` measures one user over decode.v1, `stats` summarizes (percentiles, SLOs,
JSON/CSV), `plot` draws the gaps and the timeline (matplotlib, the `plot` extra)."""
