from edgeserve.cli.main import cli

cli()
