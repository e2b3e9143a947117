"""Stand-in for ``mindspeed.ops`` (see ../../README.md)."""
