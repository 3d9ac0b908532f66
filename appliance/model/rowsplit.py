"""A call's rows shared out over the ranks and gathered back: for work every rank could do whole but each
does for a share of the rows (the indexer of a prefill chunk, its residual streams: model.Step.share), where
a row's result does not depend on the other rows. `comm` is the shard's (appliance/parallel/sharding.py
`Comm`: rank, world, all_gather), set on the module by the split; None on one device.

A call of at most SPLIT_ROWS rows is not split: a decode step's (a verify block is at most 6 rows) would
pay a collective for rows every rank scores in the time the collective takes. Every rank sees the same row
count (the ranks run the same jobs in lockstep), so every rank takes the same branch and the gather's shapes
agree."""

import torch

SPLIT_ROWS = 8
ALL_ROWS = slice(None)


def query_share(comm, rows: int) -> slice:
    """This rank's contiguous share of `rows` rows (ceil(rows / world) each, the last rank the rest), or
    ALL_ROWS where the call is not split."""
    if comm is None or rows <= max(SPLIT_ROWS, comm.world):
        return ALL_ROWS
    per = -(-rows // comm.world)
    return slice(min(comm.rank * per, rows), min((comm.rank + 1) * per, rows))


def gather_rows(comm, part: torch.Tensor, rows: int) -> torch.Tensor:
    """Every rank's share (`query_share`) of a [rows, ...] result, in row order: each padded to the same
    ceil(rows / world) rows for the gather, the padding dropped."""
    per = -(-rows // comm.world)
    if part.shape[0] < per:
        part = torch.cat((part, part.new_zeros((per - part.shape[0], *part.shape[1:]))))
    return comm.all_gather(part, dim=0)[:rows]
