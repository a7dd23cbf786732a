"""absl-flag entry points: python -m experiments.<name>."""
