"""``python -m fpaudit``: the same as the ``fpaudit`` command."""

from fpaudit.cli.commands import main

main()
