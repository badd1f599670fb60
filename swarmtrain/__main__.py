"""``python -m swarmtrain`` is the ``swarmtrain`` command."""

from swarmtrain.cli import main

main()
