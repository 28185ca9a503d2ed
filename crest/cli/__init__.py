"""The `crest` command line (typer): parses options and calls the library."""

from crest.cli.app import app, main

__all__ = ["app", "main"]
