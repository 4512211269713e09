"""`python -m cli`: poolctl without its console script."""

from cli.poolctl import main

main(prog_name="poolctl")
