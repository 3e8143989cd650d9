"""`python -m memengine.cli`: the console script (see `memengine.cli.main`)."""

from memengine.cli import main

main()
