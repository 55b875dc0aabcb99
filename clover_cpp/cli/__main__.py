"""`python -m clover_cpp.cli`: the ``clover`` command."""

from .group import note_early_sigint

note_early_sigint()  # (before the command's modules load, as the `clover` script does)

from . import main  # noqa: E402

main()
