"""`appliance tiny`: write a random checkpoint in the official names and formats."""

from pathlib import Path

import click

from appliance.model.config import FAMILIES

from .common import friendly


@click.command()
@click.argument("out_dir", type=click.Path(path_type=Path))
@click.option("--family", type=click.Choice(FAMILIES),
              default="deepseek_v41", show_default=True,
              help="deepseek_v4 carries the April MTP head; deepseek_v4_0731 the DSpark drafter")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--shape", type=click.Choice(["tiny", "slice"]), default="tiny", show_default=True,
              help="slice (deepseek_v41): 4 layers of V4.1-Flash at full width (about 5 GB), for GPU measurements")
@friendly
def tiny(out_dir, family, seed, shape):
    """Write a tiny random checkpoint (official names and formats, FP8/FP4, tokenizer.json) to OUT_DIR."""
    from .tiny_checkpoint import write_tiny

    out = write_tiny(out_dir, family, seed, shape=shape)
    click.echo(f"wrote a tiny {family} checkpoint to {out}", err=True)
