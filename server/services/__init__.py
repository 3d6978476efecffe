"""Writes and the queries behind them; routes stay thin and call these."""
