"""The `noloco` command line and its live terminal view."""
