"""``python -m rumus_fx``: print the environment report (paste it into a bug report)."""

from .environment import main

main()
