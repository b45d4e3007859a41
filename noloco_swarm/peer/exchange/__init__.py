"""The outer exchange room: the board that serves exchanges (board.py), one runner per outer
exchange (runner.py), and the byte count of each (ledger.py)."""
