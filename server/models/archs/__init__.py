"""One module per architecture family: its `Architecture` registry entries (server/models/registry.py)."""
