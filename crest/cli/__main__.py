"""Run the command line as `python -m crest.cli`."""

from crest.cli.app import main

main()
