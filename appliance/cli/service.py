"""`appliance service print | install`: the systemd unit and its env file."""

import click

from .common import friendly


@click.group()
def service():
    """The systemd unit (Type=notify, watchdog, hardening that keeps the GPUs reachable) and its env file."""


@service.command("print")
@click.option("--prefix", default="/", show_default=True, help="root the files would be installed under")
@click.option("--user", default="decode-appliance", show_default=True, help="dedicated service user")
@click.option("--devices", default="0,1,2,3", show_default=True,
              help="APPLIANCE_DEVICES in the env file (the four-GPU box; cuda: one GPU)")
@friendly
def service_print(prefix, user, devices):
    """Show the unit and the env file that `install` would write."""
    from server import service as svc

    unit, env = svc.render(svc.this_executable(), user, prefix, devices)
    unit_path, env_path = svc.paths(prefix)
    click.echo(f"# --- {unit_path}\n{unit}\n# --- {env_path}\n{env}", nl=False)


@service.command()
@click.option("--prefix", default="/", show_default=True,
              help="write under PREFIX/etc/systemd/system and PREFIX/etc/decode-appliance")
@click.option("--user", default="decode-appliance", show_default=True, help="dedicated service user")
@click.option("--devices", default="0,1,2,3", show_default=True,
              help="APPLIANCE_DEVICES in the env file (the four-GPU box; cuda: one GPU)")
@friendly
def install(prefix, user, devices):
    """Write the unit and the env file (an existing env file is kept) and print the systemctl commands."""
    from server import service as svc

    unit_path, env_path, commands = svc.install(prefix, user, devices)
    click.echo(f"wrote {unit_path}", err=True)
    click.echo(f"env file {env_path} (edit APPLIANCE_MODEL, APPLIANCE_TOKEN_FILE there)", err=True)
    click.echo("to finish:", err=True)
    for c in commands:
        click.echo(c)
