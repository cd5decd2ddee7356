"""Emulated devices and engines, driven by the real workers, store and scheduler: the
``pipeline`` suite's cluster on one small machine."""
