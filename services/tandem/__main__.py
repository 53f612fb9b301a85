from tandem.cli.main import run

raise SystemExit(run())
