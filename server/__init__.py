"""Swarmgrad coordinator: run management, credentials, bootstrap peers and progress in SQL."""
