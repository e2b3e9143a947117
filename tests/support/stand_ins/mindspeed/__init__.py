"""Stand-in for MindSpeed's plug-in surface (see ../README.md)."""
