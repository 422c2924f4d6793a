"""The command lines: `kvboost` (kvboost.py), its `kvboost models` (models.py) and `kvboost-server` (server.py)."""
